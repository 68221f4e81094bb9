"""Bad input to ``lbd analytics``: one clear line on stderr, a non-zero exit, no traceback."""

from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lbd.cli.main import main
from lbd.history.schema import BROKER_LOAD, arrow_schema
from tests.analytics.histories import T0, broker_row, write_history


def _run(capsys, *argv: str) -> tuple[int, str]:
    code = main(["analytics", *argv])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err


def test_missing_history_path(capsys, tmp_path):
    code, err = _run(capsys, "report", "--history", str(tmp_path / "nope"), "--out", str(tmp_path))
    assert code == 2
    assert err.strip() == f"lbd: error: history {tmp_path / 'nope'}: no such directory"
    code, err = _run(capsys, "replay", "--history", str(tmp_path / "nope"), "--out", str(tmp_path))
    assert code == 2 and "no such directory" in err


def test_bad_grid_and_synth_spec(capsys, tmp_path):
    code, err = _run(
        capsys,
        "replay",
        "--history",
        str(tmp_path),
        "--out",
        str(tmp_path),
        "--grid",
        "target_std=abc",
    )
    assert code == 2 and "target_std: 'abc' is not a valid float" in err
    code, err = _run(capsys, "synth", "--out", str(tmp_path / "h"), "--brokers", "1")
    assert code == 2 and "brokers must be >= 2, got 1" in err


def test_bad_generated_synth(capsys, tmp_path):
    out = str(tmp_path / "h")
    code, err = _run(capsys, "synth", "--out", out, "--generated", "0")
    assert code == 2 and err.strip() == "lbd: error: --generated must be >= 1, got 0"
    code, err = _run(capsys, "synth", "--out", out, "--generated", "3", "--seed", "-2")
    assert code == 2 and "--seed must be >= 0 with --generated, got -2" in err
    code, err = _run(
        capsys, "synth", "--out", out, "--generated", "3", "--brokers", "5", "--scenario", "churn"
    )
    assert code == 2
    assert "--generated draws each cluster from its seed; --scenario, --brokers cannot" in err
    assert not os.path.exists(out)


@pytest.mark.usefixtures("spark")
def test_wrong_schema_version(capsys, tmp_path):
    history = write_history(
        str(tmp_path / "h"), {BROKER_LOAD: [broker_row(T0, "a", 0.5, schema_version=2)]}
    )
    code, err = _run(
        capsys, "report", "--history", history, "--out", str(tmp_path / "r"), "--master", "local[2]"
    )
    assert code == 2
    assert "broker_load has schema version 2; this lbd reads version 1" in err


@pytest.mark.usefixtures("spark")
def test_not_a_history_and_empty_history(capsys, tmp_path):
    os.makedirs(tmp_path / "plain")
    code, err = _run(
        capsys,
        "report",
        "--history",
        str(tmp_path / "plain"),
        "--out",
        str(tmp_path / "r"),
        "--master",
        "local[2]",
    )
    assert code == 2 and "not an lbd history (no broker_load/ directory in it)" in err

    empty = tmp_path / "empty" / "broker_load" / "date=2024-05-01" / "hour=0"
    os.makedirs(empty)
    pq.write_table(pa.Table.from_pylist([], schema=arrow_schema(BROKER_LOAD)), empty / "p.parquet")
    code, err = _run(
        capsys,
        "report",
        "--history",
        str(tmp_path / "empty"),
        "--out",
        str(tmp_path / "r"),
        "--master",
        "local[2]",
    )
    assert code == 2 and "is empty: it has no broker load samples" in err


@pytest.mark.usefixtures("spark")
def test_missing_column(capsys, tmp_path):
    row = broker_row(T0, "a", 0.5)
    del row["load"]
    directory = tmp_path / "h" / "broker_load" / "date=2024-05-01" / "hour=0"
    os.makedirs(directory)
    pq.write_table(pa.Table.from_pylist([row]), directory / "p.parquet")
    code, err = _run(
        capsys,
        "report",
        "--history",
        str(tmp_path / "h"),
        "--out",
        str(tmp_path / "r"),
        "--master",
        "local[2]",
    )
    assert code == 2 and "load is missing" in err
