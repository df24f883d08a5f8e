"""The CLI's flags against the config they set: each names a real field, offers that field's
choices, and hands it a value of the type the (strict) config takes."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Literal, get_args, get_origin

import pytest

from headroom.app.cli import build_parser
from headroom.app.flags import _FLAGS, build_config, config_field
from headroom.config import ConfigError


def serve_parser() -> argparse.ArgumentParser:
    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return subparsers.choices["serve"]


def literal_values(annotation) -> tuple:
    if get_origin(annotation) is Literal:
        return get_args(annotation)
    return tuple(v for arg in get_args(annotation) for v in literal_values(arg))


@pytest.mark.parametrize("dest", sorted(_FLAGS))
def test_every_flag_sets_a_real_field_and_offers_its_choices(dest):
    cls, name = config_field(dest)
    assert name in {f.name for f in dataclasses.fields(cls)}, f"--{dest} sets {cls.__name__}.{name}, no such field"
    actions = [a for a in serve_parser()._actions if a.dest == dest]
    assert len(actions) == 1, f"serve has no flag --{dest}"
    allowed = literal_values(cls.__pydantic_fields__[name].annotation)
    assert tuple(actions[0].choices or ()) == allowed, f"--{dest} offers {actions[0].choices}, the config {allowed}"


SERVE = [
    "serve",
    *("--model", "m.gguf", "--served-model-name", "m", "--dtype", "float32", "--quantization", "int8"),
    *("--device", "cpu", "--attention-dtype", "float32", "--max-model-len", "512", "--enforce-eager"),
    *("--attention-backend", "torch"),
    "--no-tune-threads",
    *("--block-size", "16", "--num-kv-blocks", "64", "--kv-cache-memory-gib", "2", "--kv-cache-dtype", "float16"),
    *("--no-prefix-caching", "--max-num-seqs", "8", "--max-num-batched-tokens", "256", "--no-chunked-prefill"),
    *("--host", "0.0.0.0", "--port", "9000", "--max-body-bytes", "4096", "--max-queue-len", "5"),
    *("--drain-timeout", "3", "--unknown-fields", "accept", "--request-metrics", "--seed", "7"),
    *("--admission", "off", "--log-format", "json", "--log-prompts"),
    *("--lora-modules", "a=/x", "b=/y/z=1", "--max-lora-rank", "32", "--max-loras", "3", "--max-cpu-loras", "5"),
]


def test_every_flag_hands_the_strict_config_a_value_it_takes():
    ns = serve_parser().parse_args(SERVE[1:])
    assert {dest for dest in _FLAGS if getattr(ns, dest) is not None} == set(_FLAGS)  # SERVE gives them all
    config = build_config(ns)
    for dest in _FLAGS:
        section, name = _FLAGS[dest]
        given = getattr(ns, dest)
        given = tuple(given) if isinstance(given, list) else given  # nargs="+" flags; the config holds tuples
        if dest == "lora_modules":  # vLLM's NAME=PATH words, held as (name, path)
            given = tuple(tuple(word.split("=", 1)) for word in given)
        assert getattr(getattr(config, section) if section else config, name) == given, dest


def test_speculative_config_takes_vllms_json_and_refuses_what_it_cannot_use(tmp_path, capsys):
    table = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5, "prompt_lookup_min": 1}'
    config = build_config(serve_parser().parse_args(["--speculative-config", table]))
    assert dataclasses.astuple(config.speculative)[:4] == ("ngram", 3, 5, 1)
    suffix = '{"method": "suffix", "suffix_decoding_max_tree_depth": 16, "suffix_decoding_min_token_prob": 0.2}'
    config = build_config(serve_parser().parse_args(["--speculative-config", suffix]))
    assert dataclasses.astuple(config.speculative) == ("suffix", 4, 4, 2, 16, 1000, 1.0, 0.2, None)
    # The flag wins over the file's [speculative] table, key by key.
    path = tmp_path / "headroom.toml"
    path.write_text('[speculative]\nmethod = "ngram"\nnum_speculative_tokens = 6\n')
    ns = serve_parser().parse_args(["--config", str(path), "--speculative-config", '{"prompt_lookup_min": 3}'])
    assert dataclasses.astuple(build_config(ns).speculative)[:4] == ("ngram", 6, 4, 3)
    assert build_config(serve_parser().parse_args([])).speculative.method == "ngram"  # the default
    off = serve_parser().parse_args(["--speculative-config", '{"method": "off"}'])
    assert not build_config(off).speculative.enabled
    with pytest.raises(SystemExit):
        serve_parser().parse_args(["--speculative-config", "ngram"])
    assert "--speculative-config: expected a JSON object" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="speculative.method"):
        build_config(serve_parser().parse_args(["--speculative-config", '{"method": "eagle"}']))
    with pytest.raises(ConfigError, match="num_lookahead"):
        build_config(serve_parser().parse_args(["--speculative-config", '{"num_lookahead": 3}']))
