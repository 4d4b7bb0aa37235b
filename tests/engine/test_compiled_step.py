"""The compiled training step (``model.compile``): the same updates as the eager step, within the
batched-client tests' tolerance, from a bounded number of compiled graphs.

Each encoder and decoder layer is compiled with symbolic shapes (``distributed.parallelize.apply_compile``);
the step's inputs are prepared on the host (``SpeechLLM.prepare``) with lengths rounded up to
``STEP_BUCKETS``. float32 on both sides: the tolerance is float32's (inductor fuses and reorders
the elementwise work, so sums round differently), as in tests/engine/test_batched.py.

``slow``: inductor compiles the layers (~100 s on a cold cache, most of it C++ compilation), which
the default suite's 10-minute budget cannot carry; `.ci/run` runs the slow tests after it.
"""

from __future__ import annotations


import pytest
import torch

from engine_helpers import away_from_init, rel_diff, tiny_config

from cluster_fl.distributed import LocalComm

REL_TOL = 1e-4
pytestmark = pytest.mark.slow




def _world(tiny_corpus, out, *extra):
    from cluster_fl.engine import setup

    torch.set_num_threads(1)
    cfg = tiny_config(tiny_corpus, out, "model.dtype=float32", "fl.max_local_steps=3",
                      "fl.batch_size=2", *extra)
    return setup.build_world(cfg, LocalComm(), lambda m: None)


@pytest.fixture(scope="module")
def worlds(tiny_corpus, reference_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("compiled")
    return (_world(tiny_corpus, out / "eager", "model.compile=false"),
            _world(tiny_corpus, out / "compiled", "model.compile=true"))


@pytest.fixture(scope="module")
def state(worlds):
    return away_from_init(worlds[0].initial_state)


def test_the_compiled_step_trains_each_client_as_the_eager_step_does(worlds, state):
    import torch._dynamo

    eager, compiled = worlds
    assert eager.placement.compiled_layers == 0 and compiled.placement.compiled_layers == 6
    torch._dynamo.utils.counters.clear()
    for c in range(4):  # clients of different sizes and utterance lengths
        items = compiled.engine.clients[c].load()
        a = eager.engine.runner.train(c, items, state, 1)
        b = compiled.engine.runner.train(c, items, state, 1)
        assert a.steps == b.steps
        assert rel_diff(a.delta, b.delta) < REL_TOL, c
        assert b.loss == pytest.approx(a.loss, rel=1e-5)
    # graphs (forward + its backward): the first encoder layer (its input needs no gradient),
    # the other encoder layers, the decoder layers -- each once with a symbolic batch and once
    # specialised to a one-row batch: at most 6 whatever the utterances' lengths
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert 0 < graphs <= 6, graphs


def test_a_compiled_block_of_clients_equals_the_eager_block(worlds, state):
    eager, compiled = worlds
    block = [(c.index, c.load()) for c in compiled.engine.clients[:3]]
    a = list(eager.engine.runner.train_cohort(block, state, 1))
    b = list(compiled.engine.runner.train_cohort(block, state, 1))
    for x, y in zip(a, b):
        assert x.steps == y.steps
        assert rel_diff(x.delta, y.delta) < REL_TOL, x.client


@pytest.fixture(scope="module")
def one_row_worlds(tiny_corpus, reference_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("compiled_one_row")
    return (_world(tiny_corpus, out / "eager", "model.compile=false", "fl.batch_size=1"),
            _world(tiny_corpus, out / "compiled", "model.compile=true", "fl.batch_size=1"))


def test_one_row_steps_train_as_the_eager_step_and_read_nothing_back(one_row_worlds, state,
                                                                     monkeypatch):
    """Batches of one utterance (a client's odd last batch, ``fl.batch_size: 1``, a lane
    member's share) run graphs specialised to one row. The encoder's input once reached them as
    the transposed view of the convolutions' output, and inductor then got the layers' input
    gradient wrong (1-2% on the encoder's LoRA updates; eager within 1e-6 of float64). And a
    compiled step reads nothing back per step: the layers' Python floats are constants, not a
    float64 tensor made on the host each call (tests/host_syncs.py)."""
    from host_syncs import HostReads

    eager, compiled = one_row_worlds
    for c in range(2):
        items = compiled.engine.clients[c].load()
        a = eager.engine.runner.train(c, items, state, 1)
        b = compiled.engine.runner.train(c, items, state, 1)  # compiles (and warms) the graphs
        assert a.steps == b.steps > 1
        assert rel_diff(a.delta, b.delta) < REL_TOL, c
    items = compiled.engine.clients[1].load()
    reads = HostReads(monkeypatch)
    update = compiled.engine.runner.train(1, items, state, 1)
    assert update.steps > 1
    assert reads.n == 1, reads.report()  # the client's one read of its loss, as eagerly
