"""Pretrained weights in, trained weights out: `pd train --init-from` a folder that transformers'
own `save_pretrained` wrote, each worker reading only its stage's tensors, and `pd export` of
the checkpoint read back by transformers' `from_pretrained`. Needs the hf extra."""
import pytest
import torch

pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[hf]'")

from helpers import config_for  # noqa: E402
from test_hf import GPT2, cuts  # noqa: E402

from pdtool.artifacts.checkpoint import latest_complete, load_checkpoint  # noqa: E402
from pdtool.errors import ArtifactError  # noqa: E402
from pdtool.model.data import synthetic_source  # noqa: E402
from pdtool.model.weights import WeightFiles  # noqa: E402
from pdtool.runtime.launcher.job import prepare  # noqa: E402
from pdtool.runtime.launcher.session import run  # noqa: E402
from pdtool.zoo.hf import gpt2  # noqa: E402


def test_init_from_a_save_pretrained_folder_then_export_to_from_pretrained(tmp_path):
    import transformers

    torch.manual_seed(123)  # weights nothing in pdtool would draw
    pretrained = gpt2(**GPT2.kwargs)
    pretrained.module.save_pretrained(tmp_path / "pre")
    plan, path = cuts(tmp_path, GPT2, ["transformer.h.1.ln_1"], mode="flush")
    config = config_for(path, steps=2, group=2, init_from=str(tmp_path / "pre"), checkpoint_dir=str(tmp_path / "ckpt"),
                        return_weights=False)
    job = prepare(plan, config)
    result = run(job.config)
    inputs, target = synthetic_source(pretrained, plan.profile.batch_size, config.seed).batch(0)
    with torch.no_grad():
        expected = float(pretrained.loss_fn(pretrained.module(*inputs), target))
    assert result.losses[0] == pytest.approx(expected, rel=1e-5)  # the first minibatch saw the pretrained weights

    _, trained, _ = load_checkpoint(latest_complete(tmp_path / "ckpt"))
    from click.testing import CliRunner

    from pdtool.cli import cli

    result = CliRunner().invoke(cli, ["export", str(tmp_path / "ckpt"), "-o", str(tmp_path / "out"), "--config-from",
                                      str(tmp_path / "pre")])
    assert result.exit_code == 0 and result.output.startswith(f"wrote {tmp_path / 'out'}: 2 files"), result.output
    back = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "out")
    state = back.state_dict()
    for name, tensor in trained.items():
        assert torch.equal(state[name], tensor), name
    assert not torch.equal(state["transformer.h.0.attn.c_attn.weight"],
                           pretrained.module.state_dict()["transformer.h.0.attn.c_attn.weight"])  # it trained


def test_weights_that_do_not_fit_the_model_are_one_line_before_any_worker_starts(tmp_path):
    from safetensors.torch import save_file

    torch.manual_seed(0)
    model = gpt2(**GPT2.kwargs).module
    plan, path = cuts(tmp_path, GPT2, ["transformer.h.1.ln_1"], mode="flush")
    state = {n: t.contiguous() for n, t in model.state_dict().items() if n != "lm_head.weight"}
    cases = {
        "missing": ({n: t for n, t in state.items() if n != "transformer.h.1.mlp.c_fc.weight"},
                    r"has no transformer\.h\.1\.mlp\.c_fc\.weight, which the model needs"),
        "shape": (dict(state, **{"transformer.wpe.weight": torch.zeros(3, 16)}),
                  r"transformer\.wpe\.weight has shape \(3, 16\), the model \(8, 16\)"),
        "foreign": (dict(state, **{"encoder.extra": torch.zeros(2)}), r"holds encoder\.extra, which the model lacks"),
    }
    for name, (tensors, message) in cases.items():
        file = tmp_path / f"{name}.safetensors"
        save_file(tensors, str(file))
        with pytest.raises(ArtifactError, match=message):
            prepare(plan, config_for(path, init_from=str(file)))
    with pytest.raises(ArtifactError, match="no model.safetensors or model.safetensors.index.json"):
        WeightFiles.open(tmp_path)
