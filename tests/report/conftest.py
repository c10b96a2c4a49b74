"""One micro run for the export tests: trained once per session (8 steps, checkpoints at 0, 4, 8)
and only read by them (a test that damages files copies the run first)."""
import pytest

from mlx_open1b.train import Trainer

from data_helpers import MICRO_MIX, make_corpus
from runs import micro_cfg


@pytest.fixture(scope="session")
def micro_export_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("export_run")
    make_corpus(root / "corpus", MICRO_MIX)
    Trainer(root / "run", micro_cfg(checkpoint_every=4, peak_lr=3e-3, spike_threshold=5.0), root / "corpus",
            log=lambda m: None).train(8)
    return root / "run"
