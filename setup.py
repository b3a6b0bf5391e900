"""Build of the compiled data path (transportd._core); everything else is in pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "transportd._core",
            sources=["transportd/core/engine.c", "transportd/core/poster.c", "transportd/core/pingpong.c",
                     "transportd/core/ib_post.c", "transportd/core/verbs_shim.c", "transportd/core/efa_post.c",
                     "transportd/core/efa_arrivals.c", "transportd/core/efa_shim.c", "transportd/core/trace.c"],
            depends=["transportd/core/validate.h", "transportd/core/pingpong.h", "transportd/core/poster.h",
                     "transportd/core/verbs_abi.h", "transportd/core/verbs_abi_members.h",
                     "transportd/core/efa_arrivals.h", "transportd/core/trace.h",
                     "cmd_ring/include/transportd/cmd_ring.h", "cmd_ring/include/transportd/errors.h"],
            # the contract's C root: <transportd/cmd_ring.h> and <transportd/errors.h>, shared with the client
            include_dirs=["cmd_ring/include"],
            extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter",
                                "-Wno-missing-field-initializers"],
        )
    ]
)
