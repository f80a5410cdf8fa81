"""The PostgreSQL server of .ci/run, for the sweep tests that need several workers on one study or a password in a
storage URI."""

import os

import pytest


@pytest.fixture
def postgres() -> str:
    """The PostgreSQL server of .ci/run (``LIGHTNING_SPEC_TEST_POSTGRES``). Without one the test skips, unless
    ``LIGHTNING_SPEC_REQUIRE_POSTGRES=1`` (.ci/run sets it unless ``LIGHTNING_SPEC_ALLOW_NO_POSTGRES=1``): then
    a server that did not start fails CI instead of hiding behind a skip."""
    url = os.environ.get("LIGHTNING_SPEC_TEST_POSTGRES")
    if url:
        return url
    why = "LIGHTNING_SPEC_TEST_POSTGRES is unset (.ci/run starts a PostgreSQL server)"
    if os.environ.get("LIGHTNING_SPEC_REQUIRE_POSTGRES") == "1":
        pytest.fail(why + ", and LIGHTNING_SPEC_REQUIRE_POSTGRES=1 says this run needs it")
    pytest.skip(why)
