"""Config sizes (pydantic's ByteSize) and the ``TIERCACHE_<TABLE>__<FIELD>`` overlay (pydantic-settings)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tiercache.config import GIB, KIB, MIB, load_config, parse_size
from tiercache.errors import ConfigError


@pytest.mark.parametrize(
    ("text", "size"),
    [("4GiB", 4 * GIB), ("100 GB", 100 * 10**9), ("64MiB", 64 * MIB), ("8Gi", 8 * GIB), ("1.5k", 1500),
     ("512kib", 512 * KIB), (4096, 4096), ("12", 12)],
)
def test_sizes_are_parsed_as_pydantic_parses_them(text: str | int, size: int) -> None:
    assert parse_size(text) == size
    assert load_config({"disk": {"path": "/x", "capacity": text}}, env={}).disk.capacity == size  # type: ignore[union-attr]


@pytest.mark.parametrize("bad", [-1, "x", True, "4 bogus", 1.5])
def test_a_bad_size_names_the_field_and_an_example(bad: object) -> None:
    with pytest.raises(ConfigError) as info:
        load_config({"disk": {"path": "/x", "capacity": bad}}, env={})
    msg = str(info.value)
    assert msg.startswith("invalid config (dict): field 'disk.capacity': ") and "\n" not in msg
    assert "such as 4GiB" in msg or "cannot be negative" in msg


def test_variables_override_the_file_field_by_field(tmp_path: Path) -> None:
    config = tmp_path / "tiercache.toml"
    config.write_text(f'chunk_bytes = "1MiB"\n\n[disk]\npath = "{tmp_path}"\nio_threads = 2\n')
    env = {"TIERCACHE_DISK__IO_THREADS": "5", "TIERCACHE_S3__URL": "s3://b/p", "TIERCACHE_RAM__CAPACITY": "auto",
           "TIERCACHE_POLICY__PARAMS": '{"keep": 3}', "TIERCACHE_ENGINE__ON_ERROR": "raise",
           "TIERCACHE_LOG": "debug", "TIERCACHE_FAILPOINTS": "", "TEST_TIERCACHE_SLOW": "1"}
    cfg = load_config(config, env=env)
    assert cfg.disk is not None and (cfg.disk.path, cfg.disk.io_threads) == (tmp_path, 5)
    assert cfg.s3 is not None and (cfg.s3.bucket, cfg.s3.prefix) == ("b", "p")
    assert cfg.ram is not None and cfg.ram.capacity == "auto"
    assert (cfg.policy.params, cfg.engine.on_error, cfg.chunk_bytes) == ({"keep": 3}, "raise", MIB)


@pytest.mark.parametrize(
    ("env", "named"),
    [({"TIERCACHE_POLICY__PARAMS": "{keep: 3"}, "TIERCACHE_POLICY__PARAMS"),
     ({"TIERCACHE_SLOW": "1"}, "TIERCACHE_SLOW"),
     ({"TIERCACHE_DISK__PATHS": "/y"}, "TIERCACHE_DISK__PATHS")],
)
def test_a_variable_that_names_no_field_or_is_not_json_is_named(tmp_path: Path, env: dict[str, str],
                                                                  named: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config({"disk": {"path": str(tmp_path)}}, env=env)
    msg = str(info.value)
    assert msg.startswith(f"invalid config from environment variable {named}: ") and "\n" not in msg


def test_a_misspelt_field_is_named_first_with_the_closest_known_one(tmp_path: Path) -> None:
    # The typo is the mistake; "disk.path: Field required" is only its fallout.
    config = tmp_path / "tiercache.toml"
    config.write_text('[disk]\npaht = "x"\n')
    with pytest.raises(ConfigError) as info:
        load_config(config, env={})
    assert str(info.value) == (f"invalid config {config}: field 'disk.paht': unknown field: did you mean 'path'? "
                               "(and 1 more)")
    with pytest.raises(ConfigError) as info:
        load_config({"disk": {"path": "/x"}, "policy": {"name": "write-through", "parms": {}}}, env={})
    assert str(info.value) == "invalid config (dict): field 'policy.parms': unknown field: did you mean 'params'?"
    with pytest.raises(ConfigError) as info:
        load_config({"disk": {"path": "/x"}}, env={"TIERCACHE_DISK__PAHT": "/y"})
    assert str(info.value) == ("invalid config from environment variable TIERCACHE_DISK__PAHT: field 'disk.paht': "
                               "unknown field: did you mean TIERCACHE_DISK__PATH?")


def test_code_wins_over_the_environment_and_the_environment_says_what_it_did(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # One precedence for every source (pydantic-settings'): code > environment > file > defaults.
    env = {"TIERCACHE_DISK__PATH": "/from-env", "TIERCACHE_DISK__IO_THREADS": "7", "TIERCACHE_S3__URL": "s3://b/p",
           "TIERCACHE_POLICY__NAME": "keep-best", "TIERCACHE_CHUNK_BYTES": "2MiB"}
    given = {"disk": {"path": str(tmp_path), "capacity": "1GB"}, "policy": {"name": "write-through"},
             "chunk_bytes": "2MiB"}
    with caplog.at_level("INFO", logger="tiercache.config"):
        cfg = load_config(given, env=env)
    assert cfg.disk is not None and (cfg.disk.path, cfg.disk.capacity, cfg.disk.io_threads) == (tmp_path, 10**9, 7)
    assert cfg.policy.name == "write-through" and cfg.chunk_bytes == 2 * MIB
    assert cfg.s3 is not None and cfg.s3.bucket == "b"
    said = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert said == [
        ("INFO", "environment variable TIERCACHE_DISK__IO_THREADS sets disk.io_threads (the config given in code "
                 "leaves it unset)"),
        ("WARNING", "environment variable TIERCACHE_DISK__PATH is ignored: the config given in code sets disk.path "
                    "(code wins over the environment; unset the variable or change the code)"),
        ("WARNING", "environment variable TIERCACHE_POLICY__NAME is ignored: the config given in code sets "
                    "policy.name (code wins over the environment; unset the variable or change the code)"),
        ("WARNING", "environment variable TIERCACHE_S3__URL adds [s3] to the config given in code"),
    ]  # TIERCACHE_CHUNK_BYTES agrees with the code: nothing to say


def test_a_config_object_is_code_too(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from tiercache.config import CacheConfig, DiskConfig

    obj = CacheConfig(disk=DiskConfig(path=tmp_path))
    assert load_config(obj, env={}) is obj
    with caplog.at_level("WARNING", logger="tiercache.config"):
        cfg = load_config(obj, env={"TIERCACHE_DISK__PATH": "/from-env", "TIERCACHE_RAM__CAPACITY": "8MiB"})
    assert cfg.disk is not None and cfg.disk.path == tmp_path
    assert cfg.ram is not None and cfg.ram.capacity == 8 * MIB
    assert [r.getMessage().split(":")[0] for r in caplog.records] == [
        "environment variable TIERCACHE_DISK__PATH is ignored",
        "environment variable TIERCACHE_RAM__CAPACITY adds [ram] to the config given in code"]


def test_a_bad_value_given_in_code_is_blamed_on_the_code_not_on_a_variable(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config({"disk": {"path": str(tmp_path), "io_threads": 0}}, env={"TIERCACHE_DISK__IO_THREADS": "3"})
    assert str(info.value).startswith("invalid config (dict): field 'disk.io_threads': ")
