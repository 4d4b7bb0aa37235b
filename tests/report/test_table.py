"""`cluster-fl table`: statistics against hand computations on crafted run folders."""

import csv
import math

import pytest

from cluster_fl.cli import main
from cluster_fl.report.results import find_runs
from cluster_fl.report.table import clustered_bootstrap_ci, summarise
from fakes import write_run


def rows(spec):
    """Eval rows from {speaker: (word_errors, ref_words)} (one utterance per speaker)."""
    return [{"utt_id": f"{s}-0", "speaker": s, "language": "en", "ref": "", "hyp": "",
             "word_errors": e, "ref_words": w, "char_errors": 0, "ref_chars": 1}
            for s, (e, w) in spec.items()]


def test_mean_and_std_over_seeds_match_hand_computation(tmp_path):
    for seed, wer in enumerate([0.2, 0.3, 0.4]):
        write_run(tmp_path / f"flat{seed}", method="flat", seed=seed, wer=wer)
    write_run(tmp_path / "fedavg0", method="none", seed=0, wer=0.1)
    cells = {c.method: c for c in summarise(find_runs([tmp_path]), resamples=200)}
    assert cells["flat"].n == 3
    assert cells["flat"].mean == pytest.approx(0.3)
    assert cells["flat"].std == pytest.approx(0.1)  # sample std, ddof = 1
    assert math.isnan(cells["fedavg"].std)  # one seed: no spread


def test_clustered_bootstrap_ci_hits_the_speaker_extremes():
    # speakers A (0 errors / 2 words) and B (2/2): resamples AA, AB, BA, BB have WER 0, .5, .5, 1;
    # P(AA) = P(BB) = 1/4 > 2.5%, so the 95% percentile CI is exactly [0, 1].
    low, high = clustered_bootstrap_ci([rows({"A": (0, 2), "B": (2, 2)})], resamples=4000)
    assert (low, high) == (0.0, 1.0)


def test_clustered_bootstrap_resamples_speakers_not_utterances():
    # one speaker with all errors over many utterances: clustering keeps the CI degenerate only when
    # the speaker set is fixed; two identical-WER speakers give a zero-width CI at that WER.
    same = rows({"A": (1, 4), "B": (2, 8)})  # both WER 0.25
    assert clustered_bootstrap_ci([same], resamples=500) == pytest.approx((0.25, 0.25))


def test_ci_resamples_seeds_as_well_as_speakers():
    # seed 0: constant 0.2, seed 1: constant 0.4 (other speakers each): a resample averages two
    # drawn seeds, 0.2, 0.3 or 0.4 -- training randomness widens the CI to [0.2, 0.4] (redrawing
    # speakers alone would say [0.3, 0.3], as the table's CI did before the seed was the unit)
    a, b = rows({"A": (1, 5), "B": (2, 10)}), rows({"C": (2, 5), "D": (4, 10)})
    assert clustered_bootstrap_ci([a, b], resamples=300) == pytest.approx((0.2, 0.4))


def test_cells_with_the_same_seeds_and_speakers_share_one_draw(tmp_path):
    """Two methods whose runs have the same per-speaker rows get the same CI: one draw of seeds
    and speakers serves every method of the table."""
    for method in ("flat", "uniform"):
        for seed, spec in enumerate([{"A": (1, 5), "B": (4, 10)}, {"A": (2, 5), "B": (1, 10)}]):
            write_run(tmp_path / f"{method}{seed}", method=method, seed=seed, eval_rows=rows(spec))
    cells = {c.method: c for c in summarise(find_runs([tmp_path]), resamples=500)}
    assert (cells["flat"].ci_low, cells["flat"].ci_high) == \
        (cells["uniform"].ci_low, cells["uniform"].ci_high)


def test_table_layout_rows_arch_condition_columns_methods(tmp_path, capsys):
    for arch in ("whisper-tinyllama", "voxtral"):
        for frozen in (True, False):
            for method in ("flat", "alpha-split"):
                write_run(tmp_path / f"{arch}{frozen}{method}", arch=arch, freeze_encoder=frozen,
                          method=method, pools=("encoder", "decoder"))
    assert main(["table", str(tmp_path), "--bootstrap", "100"]) == 0
    text = capsys.readouterr().out
    header = next(line for line in text.splitlines() if line.startswith("| arch | condition | flat"))
    assert "alpha-split α=0.05" in header
    body = [line for line in text.splitlines() if line.startswith("| voxtral |")]
    assert len(body) == 2 + 4  # 2 WER rows (frozen, unfrozen) + 4 privacy rows


def _privacy_rows(text: str) -> list[dict[str, str]]:
    """The privacy table of ``table --format md`` as {column: cell} rows."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| arch | condition | method"))
    header = [c.strip() for c in lines[start].strip("|").split("|")]
    return [dict(zip(header, (c.strip() for c in line.strip("|").split("|"))))
            for line in lines[start + 2:] if line.startswith("|")]


def test_privacy_columns_are_each_pools_sigma_and_epsilon_averaged_over_seeds(tmp_path, capsys):
    # two seeds of one cell with different sigma and epsilon: the table, not the folders, must
    # produce the means, and put each pool's sigma under its own column
    write_run(tmp_path / "s0", method="alpha-split", seed=0, sigma=0.1, epsilon=3.0,
              pools=("encoder", "decoder"))
    write_run(tmp_path / "s1", method="alpha-split", seed=1, sigma=0.2, epsilon=5.0,
              pools=("encoder", "decoder"))
    write_run(tmp_path / "flat", method="flat", seed=0, sigma=0.3, epsilon=7.0, pools=("all",))
    assert main(["table", str(tmp_path), "--bootstrap", "20"]) == 0
    rows = {r["method"]: r for r in _privacy_rows(capsys.readouterr().out)}
    split = rows["alpha-split α=0.05"]
    assert split["σ/encoder"] == f"{(0.1 + 0.2) / 2 / math.sqrt(0.05):.4f}"  # 0.6708
    assert split["σ/decoder"] == f"{(0.1 + 0.2) / 2 / math.sqrt(0.95):.4f}"  # 0.1539
    assert split["σ/all"] == "—" and split["ε"] == "4.000"
    assert rows["flat"]["σ/all"] == "0.3000" and rows["flat"]["σ/encoder"] == "—"


@pytest.mark.parametrize("fmt, marker", [("latex", r"\toprule"), ("csv", "wer_mean,wer_std")])
def test_table_formats_and_out_file(tmp_path, fmt, marker):
    write_run(tmp_path / "runs" / "a", seed=0, wer=0.25)
    write_run(tmp_path / "runs" / "b", seed=1, wer=0.35)
    out = tmp_path / f"table.{fmt}"
    assert main(["table", str(tmp_path / "runs"), "--format", fmt, "--out", str(out),
                 "--bootstrap", "50"]) == 0
    text = out.read_text()
    assert marker in text
    # the one cell: mean 0.30 and sample std 0.0707 of the two seeds (a table that dropped a run
    # would say 0.25 or 0.35, n=1)
    if fmt == "latex":
        assert r"& flat \\" in text
        assert r"& unfrozen & 0.3000 $\pm$ 0.0707 [" in text and "(n=2)" in text
    else:
        rows = list(csv.DictReader(text.splitlines()))
        assert len(rows) == 1 and rows[0]["method"] == "flat", rows
        assert rows[0]["n_seeds"] == "2" and rows[0]["seeds"] == "0 1"
        assert float(rows[0]["wer_mean"]) == pytest.approx(0.30)
        assert float(rows[0]["wer_std"]) == pytest.approx(0.05 * 2 ** 0.5)


def test_table_without_runs_is_a_user_error(tmp_path, capsys):
    assert main(["table", str(tmp_path)]) == 2
    assert "no run folders" in capsys.readouterr().err


def test_privacy_table_rows_have_as_many_cells_as_its_header_without_pools(tmp_path, capsys):
    # runs without pools (non-private ones, the starting model's) made a header with an empty
    # trailing cell that no row had: a broken markdown table
    write_run(tmp_path / "a", method="none", seed=0, pools=())
    write_run(tmp_path / "b", method="none", seed=1, pools=())
    assert main(["table", str(tmp_path), "--bootstrap", "20"]) == 0
    lines = capsys.readouterr().out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| arch | condition | method"))
    table = [line for line in lines[start:] if line.startswith("|")]
    assert len({line.count("|") for line in table}) == 1, table
    assert lines[start].rstrip().endswith("| δ | guarantee |")


def test_per_layer_and_per_matrix_groups_are_separate_cells_and_flat_has_no_grouping(tmp_path):
    """The study's methods clip per layer (privacy.grouping: layer); the default per matrix. A
    results folder with both keeps them apart; flat (one group) is the same under both."""
    import json

    import pyarrow.parquet as pq

    from fakes import write_table

    for name, method, grouping in [("a", "alpha-split", "layer"), ("b", "alpha-split", "matrix"),
                                   ("c", "uniform", "layer"), ("d", "flat", "layer")]:
        folder = write_run(tmp_path / name, method=method, alpha=0.1)
        final = pq.read_table(folder / "final.parquet").to_pylist()[0]
        final["config_json"] = json.dumps({"privacy": {"grouping": grouping}})
        write_table(folder / "final.parquet", [final])
    methods = sorted(c.method for c in summarise(find_runs([tmp_path]), resamples=10))
    assert methods == ["alpha-split α=0.1", "alpha-split α=0.1 per-layer", "flat",
                       "uniform per-layer"]


def test_pool_configurations_and_inside_rules_are_separate_cells(tmp_path):
    """Two K-pool runs with other shares, or split runs with another rule inside the pools, are
    other methods: their label says so, so they never share a table cell (or a paired test)."""
    import json

    import pyarrow.parquet as pq

    from fakes import write_table

    pools_3 = [{"name": "encoder", "components": ["encoder"], "share": 0.128},
               {"name": "connector", "components": ["connector"], "share": 0.689},
               {"name": "decoder", "components": ["decoder"], "share": 0.183}]
    pools_2 = [{"name": "encoder", "components": ["encoder"], "share": 0.2},
               {"name": "rest", "components": ["connector", "decoder"], "share": 0.8}]
    for name, method, privacy in [
            ("a", "pools", {"pools": pools_3}), ("b", "pools", {"pools": pools_2}),
            ("c", "pools", {"pools": pools_2, "inside_pool": "uniform"}),
            ("d", "alpha-split", {"inside_pool": "size"}),
            ("e", "alpha-split", {"inside_pool": "ema", "grouping": "layer"})]:
        folder = write_run(tmp_path / name, method=method, alpha=0.1)
        final = pq.read_table(folder / "final.parquet").to_pylist()[0]
        final["config_json"] = json.dumps({"privacy": privacy})
        write_table(folder / "final.parquet", [final])
    methods = sorted(c.method for c in summarise(find_runs([tmp_path]), resamples=10))
    assert methods == ["alpha-split α=0.1", "alpha-split α=0.1 inside ema per-layer",
                       "pools 0.128/0.689/0.183", "pools 0.2/0.8", "pools 0.2/0.8 inside uniform"]


def _with_guarantee(folder, guarantee, secure):
    """Rewrite a fake run's final row with its recorded guarantee and privacy.secure_mode."""
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    row = pq.read_table(folder / "final.parquet").to_pylist()[0]
    row.update(guarantee=guarantee, config_json=json.dumps({"privacy": {"secure_mode": secure}}))
    if secure:
        row["seed"] = None
    pq.write_table(pa.Table.from_pylist([row]), folder / "final.parquet")


def test_research_runs_are_tabled_as_simulation_and_secure_runs_as_valid(tmp_path, capsys):
    _with_guarantee(write_run(tmp_path / "research", method="flat", seed=0), "simulation", False)
    # a record from before research runs were told apart: "valid" without secure mode
    _with_guarantee(write_run(tmp_path / "old", method="size", seed=0), "valid", False)
    _with_guarantee(write_run(tmp_path / "secure", method="uniform", seed=0), "valid", True)
    _with_guarantee(write_run(tmp_path / "void", method="quantile", seed=0), "void", False)
    assert main(["table", str(tmp_path), "--bootstrap", "20"]) == 0
    rows = {r["method"]: r["guarantee"] for r in _privacy_rows(capsys.readouterr().out)}
    assert rows == {"flat": "simulation", "size": "simulation", "uniform": "valid",
                    "quantile": "void"}
    # a cell mixing a secure and a research seed says the weaker
    _with_guarantee(write_run(tmp_path / "mixed", method="uniform", seed=1), "simulation", False)
    out = tmp_path / "t.csv"
    assert main(["table", str(tmp_path), "--format", "csv", "--out", str(out),
                 "--bootstrap", "20"]) == 0
    import csv

    cells = {r["method"]: r["guarantee"] for r in csv.DictReader(out.read_text().splitlines())}
    assert cells["uniform"] == "simulation" and cells["flat"] == "simulation"


def test_runs_from_different_starting_models_are_named_on_stderr(tmp_path, capsys):
    """provenance.json's starting-model hash: a table over runs of one architecture that
    started from two models says so (a study resumed where the model was rebuilt otherwise)."""
    import json

    def provenance(folder, sha):
        (folder / "provenance.json").write_text(json.dumps(
            {"format": 1, "starting_model": {"checkpoint": "ck", "model_sha256": sha},
             "attempts": []}))

    for seed, sha in enumerate(["a" * 64, "a" * 64]):
        provenance(write_run(tmp_path / f"flat{seed}", seed=seed), sha)
    write_run(tmp_path / "old", seed=2)  # made before provenance.json: not counted
    assert main(["table", str(tmp_path), "--bootstrap", "100"]) == 0
    assert "different models" not in capsys.readouterr().err

    provenance(write_run(tmp_path / "uniform0", method="uniform"), "b" * 64)
    assert main(["table", str(tmp_path), "--bootstrap", "100"]) == 0
    err = capsys.readouterr().err
    assert "warning: the whisper-tinyllama-tiny runs start from 2 different models" in err
    assert "aaaaaaaaaaaa: 2 run(s)" in err and "bbbbbbbbbbbb: 1 run(s), e.g. uniform0" in err


def test_fixed_size_epsilon_is_marked_as_replace_one_beside_poisson(tmp_path, capsys):
    """Fixed-size (replace-one) and Poisson (add/remove) ε sat side by side labelled alike;
    now the fixed-size ones are marked. A table of Poisson runs only is unchanged."""
    import json

    import pyarrow.parquet as pq

    write_run(tmp_path / "p", method="flat", epsilon=3.0)
    fixed = write_run(tmp_path / "f", method="uniform", epsilon=4.0)
    final = pq.read_table(fixed / "final.parquet").to_pylist()
    final[0]["config_json"] = json.dumps({"fl": {"sampling": "fixed"}})
    from fakes import write_table

    write_table(fixed / "final.parquet", final)
    assert main(["table", str(tmp_path), "--bootstrap", "20"]) == 0
    out = capsys.readouterr().out
    rows = {r["method"]: r for r in _privacy_rows(out)}
    assert rows["uniform"]["ε"] == "4.000†" and rows["flat"]["ε"] == "3.000"
    assert "† ε under replace-one" in out
    assert main(["table", str(tmp_path / "p"), "--bootstrap", "20"]) == 0
    assert "†" not in capsys.readouterr().out
