"""Build of the compiled data path (transportd._core) and softverbs' spin wait (softverbs._spin); everything
else is in pyproject.toml.

One extension holds the core and both backends' C. The core (transportd/core) is the engine, validation, the
poster interface, the verbs ABI and shim, the trace recorder and the soft fabric's run of GPU copies; each
backend's C lives beside its Python (ib/csrc, efa/csrc) and reaches the core only through its poster interface
(poster.h) and verbs ABI (verbs_abi.h). They share one extension because a backend's poster and the core's
verbs shim share state at link time (poster.c: the per-thread exception a shim's Python call stashes for the
poster to raise); a backend built as its own module would need the core to export that through a capsule,
which it does not.
"""

from setuptools import Extension, setup

CORE = "transportd/core"
CONTRACT = "cmd_ring/include"

setup(
    ext_modules=[
        Extension(
            "transportd._core",
            sources=[f"{CORE}/module.c", f"{CORE}/engine.c", f"{CORE}/engine_type.c", f"{CORE}/poster.c",
                     f"{CORE}/pingpong.c", f"{CORE}/verbs_shim.c", f"{CORE}/trace.c", f"{CORE}/copy_run.c",
                     "ib/csrc/ib_post.c",
                     "efa/csrc/efa_post.c", "efa/csrc/efa_arrivals.c", "efa/csrc/efa_shim.c"],
            depends=[f"{CORE}/engine.h", f"{CORE}/validate.h", f"{CORE}/pingpong.h", f"{CORE}/copy_run.h",
                     f"{CORE}/poster.h", f"{CORE}/verbs_abi.h", f"{CORE}/verbs_abi_members.h", f"{CORE}/trace.h",
                     "efa/csrc/efa_arrivals.h",
                     f"{CONTRACT}/transportd/cmd_ring.h", f"{CONTRACT}/transportd/errors.h"],
            # the include roots: the contract's (<transportd/cmd_ring.h>, <transportd/errors.h>, shared with the
            # client) and the core's, whose poster interface and verbs ABI a backend's C includes by name
            # ("poster.h", "verbs_abi.h"); a backend's own headers sit next to its sources and are on no root
            include_dirs=[CONTRACT, CORE],
            extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter",
                                "-Wno-missing-field-initializers"],
        ),
        # softverbs' one C piece: its I/O thread's spin before it sleeps (DeviceOptions.io_spin_s)
        Extension("softverbs._spin", sources=["softverbs/csrc/spin.c"],
                  extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter"]),
    ]
)
