"""The compiled part of the install; everything else is declared in pyproject.toml.

``steptally.service.domain._partial`` combines and merges exact partial states in C
(``service/domain/partial.py`` says what it computes). It is optional: where no C
compiler is at hand the install goes on without it, and the service computes the same
bytes in Python, slower (``bench/README.md``, Scale).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "steptally.service.domain._partial",
            ["service/domain/_partial.c"],
            optional=True,
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter"],
        )
    ]
)
