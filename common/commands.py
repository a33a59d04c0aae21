"""`rlfleet init-model` (entry point in ``rlfleet.commands``): a small local Qwen2 model and its
tokenizer (or with ``--vision`` an Idefics3 vision-language model and its processor), for runs
without a model hub. Cheap to import: torch loads in the handler."""

from __future__ import annotations

import argparse
import json

from services.commands import Command
from services.errors import ConfigError


def _init_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out_dir", help="folder to write the model and tokenizer to")
    parser.add_argument("--size", default="tiny", help="tiny (~1M params), small, base100m")
    parser.add_argument("--generator", default="arith", help="dataset generator for the tokenizer")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--env",
        metavar="ENV_ID",
        help="a text env whose episodes (with its tools) also train the tokenizer",
    )
    parser.add_argument(
        "--env-kwargs", metavar="JSON", default="{}", help="the text env's arguments"
    )
    parser.add_argument(
        "--vision",
        action="store_true",
        help="a vision-language model (Idefics3: a small ViT and a Llama text model of --size) "
        "with its image processor; its tokenizer also learns the shapes generator's questions",
    )


def _init_model(args: argparse.Namespace) -> int:
    from common.models import MODEL_SIZES, VISION_SIZES, init_model, init_vision_model

    if args.vision:
        if args.size not in VISION_SIZES:
            raise ConfigError(
                f"--size: {args.size!r} has no vision model; known: {', '.join(VISION_SIZES)}"
            )
        if args.env:
            raise ConfigError("--env: text environments train text models, not --vision ones")
        generator = None if args.generator == "arith" else {"generator": args.generator}
        out = init_vision_model(args.out_dir, size=args.size, dataset=generator, seed=args.seed)
        print(f"wrote {out}")
        return 0
    if args.size not in MODEL_SIZES:
        raise ConfigError(f"--size: unknown size {args.size!r}; known: {', '.join(MODEL_SIZES)}")
    try:
        env_kwargs = json.loads(args.env_kwargs)
    except ValueError as exc:
        raise ConfigError(f"--env-kwargs: not JSON: {exc}") from exc
    if not isinstance(env_kwargs, dict):
        raise ConfigError("--env-kwargs: a JSON object of the env's arguments")
    out = init_model(
        args.out_dir,
        size=args.size,
        dataset={"generator": args.generator},
        seed=args.seed,
        env={"env_id": args.env, "kwargs": env_kwargs} if args.env else None,
    )
    print(f"wrote {out}")
    return 0


INIT_MODEL = Command(
    "create a small Qwen2 model and tokenizer on disk (no model hub)", _init_model_args, _init_model
)
