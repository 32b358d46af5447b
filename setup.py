"""The compiled part of the gateway: the prefix index's storage and KV-event decoder (gateway/kv/native/).

Everything else is in pyproject.toml; setuptools builds this extension in ``pip install`` (``make install``).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "gateway.kv._blockindex",
            sources=["gateway/kv/native/blockindex.c"],
            extra_compile_args=["-O3", "-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter",
                                "-Wno-missing-field-initializers"],
        )
    ],
)
