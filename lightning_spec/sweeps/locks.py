"""The lock every worker of one study shares, one class per storage backend.

A worker claims a trial under this lock ("count the trials; ask()"), so two workers never both start the last
trial; the first worker also creates the tables and the MLflow parent run under it. SQLite: a file lock next to
the database file. PostgreSQL: a session advisory lock (``pg_advisory_lock``); MySQL: ``GET_LOCK``. Database
locks go with the connection, so a killed worker never leaves one behind.

``check()`` opens the storage once before anything else, so an unwritable SQLite folder or an unreachable server
is one sentence naming ``storage``, not a driver's traceback.
"""

from __future__ import annotations

import contextlib
import hashlib
from abc import ABC, abstractmethod
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lightning_spec.errors import UserError
from lightning_spec.tracking import mask_uri


class StudyLock(ABC):
    """``with lock(): ...`` holds the study's lock; ``check()`` raises one sentence when the storage is unusable."""

    def __init__(self, url: str, study_name: str) -> None:
        self.url = url
        digest = hashlib.sha256(f"lightning_spec.sweep:{study_name}".encode()).digest()
        self.key = int.from_bytes(digest[:8], "big", signed=True)  # pg advisory keys are bigint
        self.name = "lightning_spec:" + digest.hex()[:40]  # MySQL lock names: at most 64 characters

    @abstractmethod
    def check(self) -> None: ...

    @abstractmethod
    def __call__(self) -> contextlib.AbstractContextManager[None]: ...


class FileStudyLock(StudyLock):
    """SQLite: a file lock beside the database file (every worker runs on this machine)."""

    def __init__(self, url: str, study_name: str, database: str | None) -> None:
        super().__init__(url, study_name)
        if not database or database == ":memory:":
            raise UserError("storage: an in-memory SQLite study is not shared; use sqlite:///optuna.db.")
        from filelock import FileLock

        self.database = Path(database).resolve()
        self._file = FileLock(str(self.database) + ".lock")

    def check(self) -> None:
        from lightning_spec.files import writable_dir

        writable_dir(self.database.parent, "storage")
        if self.database.exists() and not self.database.is_file():
            raise UserError(f"storage '{self.database}' is a folder; name a database file (sqlite:///optuna.db).")

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        with self._file:
            yield


class DatabaseStudyLock(StudyLock):
    """A server's named lock, taken on a connection of its own that ends with the lock."""

    LOCK = UNLOCK = ""  # SQL taking the bound values of _params()

    def __init__(self, url: str, study_name: str, driver: str) -> None:
        super().__init__(url, study_name)
        from sqlalchemy import create_engine
        from sqlalchemy.pool import NullPool

        # a server that swallows packets would otherwise hold `check` for the OS's TCP timeout (minutes)
        connect_args = {"connect_timeout": 20} if driver in ("psycopg2", "psycopg", "pymysql", "mysqldb") else {}
        try:
            self._engine = create_engine(url, poolclass=NullPool, connect_args=connect_args)
        except ImportError as err:
            raise UserError(
                f"storage {mask_uri(url)!r} needs a database driver that is not installed ({err}); install it "
                "(PostgreSQL: pip install psycopg2-binary; MySQL: pip install pymysql)."
            ) from None

    def check(self) -> None:
        from sqlalchemy.exc import SQLAlchemyError

        try:
            with self._engine.connect():
                pass
        except SQLAlchemyError as err:
            reason = str(getattr(err, "orig", None) or err).strip().splitlines()
            raise UserError(
                f"storage {mask_uri(self.url)!r} cannot be reached ({mask_uri(reason[0]) if reason else 'no reason'})"
                "; start the database server or correct the host, port, database, user or password in storage."
            ) from None

    @abstractmethod
    def _params(self) -> dict[str, Any]: ...

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        from sqlalchemy import text

        with self._engine.connect() as conn:
            conn = conn.execution_options(isolation_level="AUTOCOMMIT")
            conn.execute(text(self.LOCK), self._params())
            try:
                yield
            finally:
                conn.execute(text(self.UNLOCK), self._params())


class PostgresStudyLock(DatabaseStudyLock):
    """PostgreSQL: a session advisory lock on the study's 64-bit key."""

    LOCK, UNLOCK = "SELECT pg_advisory_lock(:k)", "SELECT pg_advisory_unlock(:k)"

    def _params(self) -> dict[str, Any]:
        return {"k": self.key}


class MySQLStudyLock(DatabaseStudyLock):
    """MySQL / MariaDB: a named lock, waited for without a timeout."""

    LOCK, UNLOCK = "SELECT GET_LOCK(:n, -1)", "SELECT RELEASE_LOCK(:n)"

    def _params(self) -> dict[str, Any]:
        return {"n": self.name}


def study_lock(url: str, study_name: str) -> StudyLock:
    """The lock of ``study_name`` in the Optuna RDB ``url``, by its backend."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        parsed = make_url(url)
    except ArgumentError:
        parsed = None
    backend = parsed.get_backend_name() if parsed is not None else None
    if backend == "sqlite":
        return FileStudyLock(url, study_name, parsed.database)
    if backend == "postgresql":
        return PostgresStudyLock(url, study_name, parsed.get_driver_name())
    if backend in ("mysql", "mariadb"):
        return MySQLStudyLock(url, study_name, parsed.get_driver_name())
    raise UserError(
        f"storage {mask_uri(url)!r}: sweeps need an Optuna RDB URL (sqlite:///optuna.db, postgresql://..., mysql://...)."
    )
