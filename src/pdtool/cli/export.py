"""`pd export`: a checkpoint as a Hugging Face-style safetensors folder."""
from __future__ import annotations

import click

from .group import _count, _examples, cli


@cli.command(name="export", short_help="write a checkpoint as safetensors -> DIR",
             epilog=_examples("pd export ckpt/step-00000200 -o gpt2-trained"))
@click.argument("checkpoint", type=click.Path(file_okay=False))
@click.option("-o", "--output", required=True, type=click.Path(file_okay=False),
              help="The folder to write (model-0000k-of-0000n.safetensors per stage, model.safetensors.index.json).")
@click.option("--config-from", type=click.Path(file_okay=False), metavar="DIR",
              help="A Hugging Face model folder (the one --init-from read) whose config.json and generation_config.json "
                   "to copy, so that from_pretrained reads the result as it is.")
@click.option("--force", is_flag=True, help="Replace an earlier export in the output folder (its shards and index; "
                                            "nothing else there is touched).")
def export_checkpoint(checkpoint, output, config_from, force):
    """Write a checkpoint's weights as a Hugging Face-style safetensors folder, one stage at a time.

    Not `pd export-plan`, which writes a plan's partition and schedule for torchtitan, Megatron-Core
    or torch.distributed.pipelining.

    CHECKPOINT is a checkpoint folder or a --checkpoint-dir (its newest complete checkpoint).
    Tensors keep the model's own names, so transformers' from_pretrained (with the model's
    config: --config-from) or pd train --init-from reads the folder."""
    from ..model.weights import export

    files, size = export(checkpoint, output, config_from, force=force)
    click.echo(f"wrote {output}: {_count(files, 'file')} of safetensors, {size / 2 ** 20:.1f} MiB, and its index")
