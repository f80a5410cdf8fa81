# A throwaway PostgreSQL server for the tests that need one (tests/sweeps/test_sweeps.py, tests/sweeps/test_storage.py).
# Sourced by .ci/run:
#   start_postgres   installs the server if missing (Debian's postgresql package), initdb's a cluster in a temp
#                    folder, starts it on a free port of 127.0.0.1, creates the database and exports
#                    LIGHTNING_SPEC_TEST_POSTGRES=postgresql+psycopg2://postgres@127.0.0.1:PORT/lightning_spec_test
#   stop_postgres    stops it and removes the folder (start_postgres sets it as the EXIT trap)
# Every step returns 1 on failure (callers decide: .ci/run goes on, and the tests that need the server fail,
# saying why, unless LIGHTNING_SPEC_ALLOW_NO_POSTGRES=1 lets them skip).
# initdb refuses to run as root, so as root the server runs as the `postgres` user (created if missing).

pg_bin_dir() {
    local found
    found=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1)
    if [ -n "$found" ] && [ -x "$found/initdb" ]; then echo "$found"; return; fi
    found=$(command -v initdb 2>/dev/null || true)
    if [ -n "$found" ]; then dirname "$(readlink -f "$found")"; fi
}

start_postgres() {
    local bin port as=()
    bin=$(pg_bin_dir)
    if [ -z "$bin" ]; then
        echo "postgres: installing the server (apt-get install postgresql)"
        apt-get update -qq >/dev/null
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends postgresql >/dev/null
        bin=$(pg_bin_dir)
        [ -n "$bin" ] || { echo "postgres: no initdb after apt-get install postgresql" >&2; return 1; }
    fi
    PG_DIR=$(mktemp -d /tmp/lightning-spec-pg.XXXXXX)
    if [ "$(id -u)" = 0 ]; then
        id -u postgres >/dev/null 2>&1 || useradd --system --no-create-home --shell /bin/false postgres
        chown postgres "$PG_DIR"
        as=(runuser -u postgres --)
    fi
    port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    "${as[@]}" "$bin/initdb" -D "$PG_DIR/data" -U postgres -A trust -E UTF8 --locale=C --no-sync >"$PG_DIR/initdb.log" || return 1
    "${as[@]}" "$bin/pg_ctl" -D "$PG_DIR/data" -l "$PG_DIR/server.log" -w -t 60 \
        -o "-p $port -k $PG_DIR -c listen_addresses=127.0.0.1 -c fsync=off -c synchronous_commit=off" start >/dev/null || return 1
    PG_STOP=("${as[@]}" "$bin/pg_ctl" -D "$PG_DIR/data" -m fast -w stop)
    trap stop_postgres EXIT
    "$bin/createdb" -h 127.0.0.1 -p "$port" -U postgres lightning_spec_test || return 1
    export LIGHTNING_SPEC_TEST_POSTGRES="postgresql+psycopg2://postgres@127.0.0.1:$port/lightning_spec_test"
    echo "postgres: $LIGHTNING_SPEC_TEST_POSTGRES"
}

stop_postgres() {
    if [ -n "${PG_DIR:-}" ]; then
        "${PG_STOP[@]}" >/dev/null 2>&1 || true
        rm -rf "$PG_DIR"
        PG_DIR=
    fi
}
