"""The tests' PostgreSQL server: ``sglang_adatree.tools.postgres``, which ``adatree soak`` uses
too."""

from sglang_adatree.tools.postgres import PostgresServer, find_bin_dir

__all__ = ["PostgresServer", "find_bin_dir"]
