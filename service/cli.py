"""The ``steptally`` command: ``migrate``, ``serve``, ``demo``, ``grafana build``, ``sync``,
``alert-log``.

    steptally migrate [--database-url URL]
    steptally serve   [--database-url URL] [--host H] [--port P] [--workers N]
    steptally demo    [--url URL | --serve] [--run NAME] [--steps N] [--ranks N] [--interval S]
    steptally grafana build [--out DIR] [--check]
    steptally sync    URL [--spool-root DIR] [--token T]
    steptally alert-log [--host H] [--port P]
    steptally token create --scope {admin,ingest,read} [--run NAME] [--label TEXT]
    steptally token list | steptally token revoke ID     (each [--database-url URL])

Options fall back to the ``STEPTALLY_*`` environment variables of
:class:`~steptally.service.settings.Settings`.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer
from pydantic import ValidationError
from sqlalchemy import exc as sql_errors

from steptally.service.errors import NotMigrated
from steptally.service.settings import Settings, database_limits

if TYPE_CHECKING:
    from steptally.service.auth.tokens import TokenStore

app = typer.Typer(
    name="steptally",
    help="Exact per-step diagnostics for RL training runs.",
    no_args_is_help=True,
    add_completion=False,
)

DatabaseUrl = Annotated[
    str | None, typer.Option("--database-url", help="SQLAlchemy URL (default from settings).")
]


# what a database URL that is wrong, or a database that is away, raises
DATABASE_FAULTS = (sql_errors.OperationalError, sql_errors.InterfaceError, sql_errors.ArgumentError)


def settings_with(**overrides: Any) -> Settings:
    """Settings from the environment, with the options given on the command line; an
    invalid one is one line on stderr and exit status 2."""
    try:
        return Settings(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        _fail(f"invalid setting {where}: {first['msg']}")


def _fail(message: str) -> NoReturn:
    typer.echo(f"steptally: {message}", err=True)
    raise typer.Exit(2)


def _unreachable(url: str, exc: Exception) -> NoReturn:
    """One line for a database that cannot be reached (no traceback)."""
    cause = getattr(exc, "orig", None) or exc
    reason = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
    _fail(f"cannot reach the database {_safe(url)}: {reason}")


@app.command()
def migrate(database_url: DatabaseUrl = None) -> None:
    """Create the database schema, or upgrade it to the newest version."""
    from steptally.service.store.migration import upgrade

    settings = settings_with(database_url=database_url)
    try:
        upgrade(settings.database_url)
    except DATABASE_FAULTS as exc:
        _unreachable(settings.database_url, exc)
    typer.echo(f"the database is at the newest schema version: {_safe(settings.database_url)}")


@app.command()
def serve(
    database_url: DatabaseUrl = None,
    host: Annotated[str | None, typer.Option(help="Address to listen on.")] = None,
    port: Annotated[int | None, typer.Option(help="Port to listen on.")] = None,
    workers: Annotated[
        int, typer.Option(min=1, help="Server processes (all share the database).")
    ] = 1,
    cpus: Annotated[
        str | None,
        typer.Option(
            help="Cores to run on, a Linux CPU list (1, 0-3): one process on all of them, "
            "or each of --workers N alone on one, in turn."
        ),
    ] = None,
) -> None:
    """Run the aggregation service (refuses an unmigrated database).

    With ``--workers N`` uvicorn runs N processes, each building its own app from the
    same settings; SQL stays the only source of truth and a step is finalised under
    its row lock, so any number of processes answer alike.
    """
    from steptally.service.serving import serve as serve_until_stopped
    from steptally.service.serving import unusable_cpus
    from steptally.service.store.engine import make_engine
    from steptally.service.store.migration import check_current

    settings = settings_with(database_url=database_url, host=host, port=port, cpus=cpus)
    unusable, usable = unusable_cpus(settings)
    if unusable:
        listed = ", ".join(str(c) for c in unusable)
        _fail(f"cannot serve on core {listed}: this process may run on {usable}")
    try:
        engine = make_engine(settings.database_url, database_limits(settings))
        check_current(engine, settings.database_url)
        engine.dispose()
    except NotMigrated as exc:
        _fail(f"cannot serve: {exc.message}")
    except DATABASE_FAULTS as exc:
        _unreachable(settings.database_url, exc)
    status = serve_until_stopped(settings, workers)
    if status != 0:
        _fail(f"cannot serve: the {workers} workers did not start (see above)")


@app.command()
def demo(
    url: Annotated[str | None, typer.Option(help="A running service to push to.")] = None,
    serve_too: Annotated[
        bool, typer.Option("--serve", help="Migrate and serve the embedded default here.")
    ] = False,
    database_url: DatabaseUrl = None,
    port: Annotated[int | None, typer.Option(help="Port for --serve.")] = None,
    run: Annotated[
        str | None, typer.Option(help="Run name (default: demo-grpo-<date>-<time>, a new run).")
    ] = None,
    steps: Annotated[int, typer.Option(min=1, help="Steps to simulate.")] = 120,
    ranks: Annotated[int, typer.Option(min=1, max=64, help="Ranks to simulate.")] = 8,
    interval: Annotated[
        float, typer.Option(min=0.0, help="Seconds between steps (slow enough to watch).")
    ] = 1.0,
    keep_serving: Annotated[
        bool, typer.Option(help="With --serve, keep serving after the demo (Ctrl-C stops).")
    ] = True,
) -> None:
    """A simulated GRPO run pushing real loss fragments (needs the torch extra)."""
    try:
        import torch  # noqa: F401  (only the demo's simulated ranks need it)

        from steptally.client.demo import DemoPlan, run_demo
    except ImportError as exc:
        typer.echo(f"steptally: the demo needs torch: pip install 'steptally[torch]' ({exc})")
        raise typer.Exit(2) from None
    started = time.localtime()
    name = run or time.strftime("demo-grpo-%Y%m%d-%H%M%S", started)
    # a new run each time, with its own draw of the data, so runs can be compared
    seed = int(time.mktime(started)) if run is None else 0
    plan = DemoPlan(run=name, steps=steps, ranks=ranks, step_interval_s=interval, seed=seed)
    if not serve_too:
        base = url or "http://127.0.0.1:8000"
        typer.echo(f"steptally: watch the run at {base}/runs/{name}")
        run_demo(base, plan, typer.echo)
        return
    from steptally.service.embedded import EmbeddedServer

    settings = settings_with(database_url=database_url, port=port)
    with EmbeddedServer(settings) as server:
        typer.echo(f"steptally: dashboard  {server.url}/  (this run: {server.url}/runs/{name})")
        typer.echo(f"steptally: REST API   {server.url}/docs   Prometheus {server.url}/metrics")
        run_demo(server.url, plan, typer.echo)
        if keep_serving:
            typer.echo(f"steptally: still serving; the dashboard is at {server.url}/; Ctrl-C stops")
            server.wait()


@app.command("alert-log")
def alert_log(
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 9099,
) -> None:
    """Receive Alertmanager's webhook and log every alert (GET /alerts lists them)."""
    import uvicorn

    from steptally.service.alert_log import create_app

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    uvicorn.run(create_app(), host=host, port=port, log_level="warning")


grafana = typer.Typer(help="Grafana dashboards as code.", no_args_is_help=True)
app.add_typer(grafana, name="grafana")


@grafana.command("build")
def grafana_build(
    out: Annotated[
        Path | None, typer.Option(help="Folder of the JSON (default deploy/grafana/dashboards).")
    ] = None,
    check: Annotated[
        bool, typer.Option("--check", help="Write nothing; fail if a file differs from a build.")
    ] = False,
) -> None:
    """Build the dashboards (needs the grafana extra)."""
    from steptally.service.grafana import build

    directory = out or build.DEFAULT_DIR
    if check:
        stale = build.stale(directory)
        for path in stale:
            typer.echo(f"steptally: {path} differs from a fresh build", err=True)
        if stale:
            raise typer.Exit(1)
        typer.echo(f"the dashboards in {directory} are up to date")
        return
    for path in build.write(directory):
        typer.echo(f"wrote {path}")


@app.command()
def sync(
    url: Annotated[str, typer.Argument(help="The service, e.g. http://127.0.0.1:8000.")],
    spool_root: Annotated[
        Path | None,
        typer.Option("--spool-root", help="Where the spools are (default: the reporter's)."),
    ] = None,
    token: Annotated[
        str | None, typer.Option(envvar="STEPTALLY_TOKEN", help="Bearer token for the service.")
    ] = None,
) -> None:
    """Deliver the spools reporters left behind; exit 1 if anything is left."""
    from steptally.client.reporter.options import default_spool_root
    from steptally.client.reporter.sync import sync as deliver

    report = deliver(url, spool_root or default_spool_root(), token, say=typer.echo)
    for reason in report.reasons:
        typer.echo(f"rejected: {reason}")
    typer.echo(report.line())
    if report.left_files:
        raise typer.Exit(1)


token = typer.Typer(help="Bearer tokens (docs/security.md).", no_args_is_help=True)
app.add_typer(token, name="token")


def _token_store(database_url: str | None) -> TokenStore:
    """The token store of the configured database, which must be at the newest schema."""
    from steptally.service.auth.tokens import TokenStore
    from steptally.service.store.engine import make_engine
    from steptally.service.store.migration import check_current

    settings = settings_with(database_url=database_url)
    try:
        engine = make_engine(settings.database_url, database_limits(settings))
        check_current(engine, settings.database_url)
    except NotMigrated as exc:
        _fail(exc.message)
    except DATABASE_FAULTS as exc:
        _unreachable(settings.database_url, exc)
    return TokenStore(engine)


@token.command("create")
def token_create(
    scope: Annotated[
        str, typer.Option(help="admin (everything), ingest (post fragments) or read.")
    ],
    run: Annotated[
        str | None, typer.Option(help="Bind an ingest or read token to this run only.")
    ] = None,
    label: Annotated[
        str | None, typer.Option(help="What the token is for, shown by `token list`.")
    ] = None,
    database_url: DatabaseUrl = None,
) -> None:
    """Create a token; its secret is printed once, alone on the last line."""
    from steptally.service.auth.tokens import Scope
    from steptally.service.domain.run import is_run_name

    if scope not in {s.value for s in Scope}:
        _fail(f"--scope must be admin, ingest or read, not {scope!r}")
    if run is not None and not is_run_name(run):
        _fail(f"--run {run!r} is not a run name (letters, digits, '_', '.', '-'; 128 at most)")
    if run is not None and scope == Scope.ADMIN:
        _fail("an admin token is never bound to a run; leave out --run")
    if label is not None and len(label) > 128:
        _fail("--label is longer than 128 characters")
    store = _token_store(database_url)
    try:
        created = store.create(Scope(scope), run, label)
    except DATABASE_FAULTS as exc:
        _unreachable(str(store.engine.url), exc)
    finally:
        store.close()
    bound = f", run {run}" if run else ""
    typer.echo(f"created token {created.token.id} (scope {scope}{bound}); its secret, shown once:")
    typer.echo(created.secret)


@token.command("list")
def token_list(database_url: DatabaseUrl = None) -> None:
    """Every token (id, scope, run, created, revoked, label); never a secret."""
    store = _token_store(database_url)
    try:
        tokens = store.list()
    finally:
        store.close()
    typer.echo(f"{'id':<16}  {'scope':<6}  {'run':<20}  {'created':<20}  {'revoked':<20}  label")
    for t in tokens:
        typer.echo(
            f"{t.id:<16}  {t.scope.value:<6}  {t.run or '-':<20}  {_when(t.created_at):<20}  "
            f"{_when(t.revoked_at):<20}  {t.label or ''}".rstrip()
        )


@token.command("revoke")
def token_revoke(
    token_id: Annotated[str, typer.Argument(metavar="ID", help="The id `token list` shows.")],
    database_url: DatabaseUrl = None,
) -> None:
    """Revoke a token: every replica refuses it from its next request on."""
    from steptally.service.auth.tokens import UnknownToken

    store = _token_store(database_url)
    try:
        revoked = store.revoke(token_id)
    except UnknownToken as exc:
        typer.echo(f"steptally: {exc}", err=True)
        raise typer.Exit(1) from None
    finally:
        store.close()
    typer.echo(f"revoked token {revoked.id} at {_when(revoked.revoked_at)}")


def _when(at: float | None) -> str:
    return "-" if at is None else time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(at))


def _safe(url: str) -> str:
    from sqlalchemy.engine import make_url

    try:
        return make_url(url).render_as_string(hide_password=True)
    except sql_errors.ArgumentError:
        return repr(url)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
