"""A real S3 HTTP server on loopback for tests and benchmarks: the local backend's own
(`asyncgrpo.local.s3`, moto's `moto_server`), named here so tests find it with the rest of
their scaffolding."""

from asyncgrpo.local.s3 import S3Server

__all__ = ["S3Server"]
