"""``cluster-fl table --norms``: the runs' per-component update norms, the decoder/encoder ratio
(calibrate's definition, from the clients' logged norms) and the clip rates, per table cell."""

import math

import pytest

from cluster_fl.commands import table as table_cmd
from cluster_fl.report.norm_table import norm_rows, norms_csv, norms_markdown
from cluster_fl.report.results import find_runs
from fakes import GROUP_NORMS, write_run


def _args(results, **kw):
    import argparse

    base = dict(results=[str(results)], format="md", out=None, bootstrap=50, against=None,
                norms=True)
    return argparse.Namespace(**{**base, **kw})


def test_component_norms_ratio_and_clip_rate_are_the_rounds_means(tmp_path):
    for seed in (0, 1):
        write_run(tmp_path / f"flat_s{seed}", method="flat", seed=seed, rounds=4)
    write_run(tmp_path / "fedavg_s0", method="none", seed=0, rounds=4)
    rows = norm_rows(find_runs([tmp_path]))
    assert [r.method for r in rows] == ["fedavg", "flat"]
    flat = rows[1]
    assert flat.n == 2 and flat.rounds == 4
    harmonic = sum(1 / r for r in range(1, 5)) / 4  # the fake's norms fall as 1/round
    for comp, norm in GROUP_NORMS.items():
        assert flat.components[comp] == pytest.approx(norm * harmonic)
    assert flat.ratio == pytest.approx(GROUP_NORMS["decoder"] / GROUP_NORMS["encoder"])
    assert flat.ratio_std == pytest.approx(0.0, abs=1e-9)
    assert flat.clip_rate == pytest.approx(0.9 * harmonic)
    assert flat.clip_rate_last == pytest.approx(0.9 / 4)


def test_runs_without_group_norms_are_left_out_and_no_norms_at_all_is_an_error(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    bare = write_run(tmp_path / "size_s0", method="size", rounds=2)
    rows = pq.read_table(bare / "rounds.parquet").to_pylist()
    pq.write_table(pa.Table.from_pylist([{k: v for k, v in r.items() if not k.startswith("norm/")}
                                         for r in rows]), bare / "rounds.parquet")
    assert norm_rows(find_runs([tmp_path])) == []
    write_run(tmp_path / "flat_s0", method="flat", rounds=2)
    assert [r.method for r in norm_rows(find_runs([tmp_path]))] == ["flat"]
    with pytest.raises(Exception, match="no run logged per-group norms"):
        table_cmd.run(_args(tmp_path / "size_s0"))


def test_markdown_and_csv_carry_the_same_numbers(tmp_path, capsys):
    write_run(tmp_path / "flat_s0", method="flat", rounds=3)
    rows = norm_rows(find_runs([tmp_path]))
    md = norms_markdown(rows)
    header, line = md.splitlines()[2], md.splitlines()[4]
    assert "decoder/encoder" in header and "clip rate" in header
    assert "| 10.0× |" in line and "| 0.550 (last 0.300) |" in line  # one seed: no ± std
    lines = norms_csv(rows).strip().splitlines()
    head, row = lines[0].split(","), lines[1].split(",")
    values = dict(zip(head, row))
    assert float(values["ratio_decoder_encoder"]) == pytest.approx(10.0)
    assert math.isclose(float(values["norm/encoder"]), rows[0].components["encoder"])
    assert table_cmd.run(_args(tmp_path, format="csv")) == 0
    assert capsys.readouterr().out == norms_csv(rows)


def test_norms_and_against_do_not_combine(tmp_path):
    write_run(tmp_path / "flat_s0", method="flat")
    with pytest.raises(Exception, match="--norms"):
        table_cmd.run(_args(tmp_path, against="flat"))
    with pytest.raises(Exception, match="--norms"):
        table_cmd.run(_args(tmp_path, format="latex"))
