"""Build of the compiled data path (transportd._core); everything else is in pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "transportd._core",
            sources=["transportd/core/engine.c", "transportd/core/pingpong.c"],
            depends=["transportd/core/validate.h", "transportd/core/pingpong.h",
                     "cmd_ring/include/transportd/cmd_ring.h"],
            extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter",
                                "-Wno-missing-field-initializers"],
        )
    ]
)
