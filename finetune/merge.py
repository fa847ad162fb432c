"""``python -m finetune.merge --adapter_dir RUN/final --output_dir DIR``: a LoRA adapter merged into
its base (peft's ``merge_and_unload``), written as a full model folder that the chat, transformers
and the training pipeline load like any other.

DIR gets model.safetensors and config.json, the tokenizer, a generation config (the base's, with
the run's evaluation settings, as a full run's ``final/``), training_args.json (the adapter run's,
so the chat formats input the same way, plus ``merged_from``: which adapter, on which base) and
all_results.json, and a model card. It is written under a temporary name next to DIR and renamed
when complete: DIR is never half-written, and an existing DIR is never touched.
"""

from __future__ import annotations

import argparse
import json
import logging
import secrets
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

from chat.adapters import FINGERPRINT_KEY, base_of, is_adapter_dir, model_fingerprint
from chat.layout import RESULTS_FILE, TRAINING_ARGS_FILE
from chat.model import ModelLoadError, load_model, load_tokenizer
from finetune import checkpoint as ckpt

log = logging.getLogger("finetune.merge")

MERGED_FROM = "merged_from"  # training_args.json of a merged model: {"adapter", "base", "base_fingerprint"}


class MergeError(RuntimeError):
    """The adapter cannot be merged (not an adapter, base not loadable or changed, DIR exists)."""


def merge(adapter_dir: str | Path, output_dir: str | Path) -> Path:
    """Merge the LoRA adapter in ``adapter_dir`` into its base and write the full model to
    ``output_dir`` (which must not exist); returns it."""
    adapter, out = Path(adapter_dir), Path(output_dir)
    if not is_adapter_dir(adapter):
        raise MergeError(
            f"{adapter} is not a LoRA adapter folder (no adapter_config.json and adapter_model.safetensors); "
            "a full model needs no merging"
        )
    if out.exists():
        raise MergeError(f"{out} already exists: choose a new --output_dir (nothing is overwritten)")
    try:
        base, recorded = base_of(adapter)
    except ValueError as err:
        raise MergeError(str(err)) from None
    try:
        model = load_model(base)
    except ModelLoadError as err:
        raise MergeError(f"cannot load the base of the adapter in {adapter}: {err}") from None
    found = model_fingerprint(model)
    if recorded is not None and recorded != found:
        raise MergeError(
            f"the adapter in {adapter} was trained on {base} with fingerprint {recorded}, but {base} now has "
            f"{found}: it changed since the adapter was trained, and the merge would not be that model"
        )
    from peft import PeftModel

    merged = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    args = read_json(adapter / TRAINING_ARGS_FILE)
    tokenizer = load_tokenizer(str(adapter) if (adapter / "tokenizer_config.json").is_file() else base)
    tmp = out.parent / f".{out.name}.tmp-{secrets.token_hex(4)}"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
        merged.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if args is not None:
            write_generation_config(merged, args, tmp)
            record = {"adapter": str(adapter.resolve()), "base": base, FINGERPRINT_KEY: found}
            (tmp / TRAINING_ARGS_FILE).write_text(json.dumps({**args, MERGED_FROM: record}, indent=2))
        if (adapter / RESULTS_FILE).is_file():
            shutil.copyfile(adapter / RESULTS_FILE, tmp / RESULTS_FILE)
        write_card(tmp, adapter, base)
        for path in [tmp, *tmp.rglob("*")]:  # served by the app: readable like a run's final/
            path.chmod(0o755 if path.is_dir() else 0o644)
        if out.exists():
            raise MergeError(f"{out} appeared while merging: nothing is overwritten")
        tmp.rename(out)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(err, Exception) and ckpt.is_disk_full(err, out.parent):
            free, mount = ckpt.free_space(out.parent)
            raise MergeError(f"disk full while writing {out}: {ckpt.human_bytes(free)} free on {mount}") from err
        raise
    return out


def read_json(path: Path) -> dict | None:
    """A JSON object file, or None when there is none (an adapter made elsewhere has no training_args)."""
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise MergeError(f"{path}: unreadable ({err})") from None
    if not isinstance(data, dict):
        raise MergeError(f"{path}: not a JSON object")
    return data


def write_generation_config(model, args: dict, folder: Path) -> None:
    """The base's generation config with the run's evaluation settings, as a full run saves it."""
    from finetune.config import TrainConfig
    from finetune.evaluate import generation_kwargs

    defaults = {name: getattr(TrainConfig, name, None) for name in TrainConfig.__dataclass_fields__}
    settings = SimpleNamespace(**{**defaults, **args})
    settings.val_max_target_length = settings.val_max_target_length or settings.max_target_length
    gen = model.generation_config
    for key, value in generation_kwargs(settings).items():
        setattr(gen, key, value)
    gen.save_pretrained(folder)


def write_card(folder: Path, adapter: Path, base: str) -> None:
    """README.md: a full model (library transformers) made of ``base`` and the adapter, followed by the
    adapter's own card (what it was trained on, BLEU, the command)."""
    from huggingface_hub import ModelCard, ModelCardData

    from chat.layout import is_hub_id

    data = ModelCardData(
        base_model=base if is_hub_id(base, owner=True) else None,
        library_name="transformers",
        pipeline_tag="text2text-generation",
        tags=["blenderbot", "persona-chat", "lora", "merged"],
    )
    body = ""
    if (adapter / "README.md").is_file():
        body = ModelCard((adapter / "README.md").read_text()).text
    text = (
        f"---\n{data.to_yaml()}\n---\n\n# {adapter.parent.name} (merged)\n\n"
        f"BlenderBot `{base}` with the LoRA adapter `{adapter.parent.name}/{adapter.name}` merged into its weights "
        f"(`python -m finetune.merge`): a full model, loaded without peft. The adapter's card follows.\n\n{body}"
    )
    (folder / "README.md").write_text(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m finetune.merge",
        description="Merge a LoRA adapter (a LoRA run's final/) into its base and write a full model folder.",
    )
    parser.add_argument("--adapter_dir", required=True, help="the adapter folder (RUN/final of a --adapter lora run)")
    parser.add_argument("--output_dir", required=True, help="where the full model goes (must not exist)")
    args = parser.parse_args(argv)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S", level="INFO")
    try:
        out = merge(args.adapter_dir, args.output_dir)
    except MergeError as err:
        log.error("%s", err)
        return 1
    log.info(f"merged {args.adapter_dir} into a full model in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
