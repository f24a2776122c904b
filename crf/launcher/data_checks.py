"""Checks before launch of the user's own data, model and rewards, on the launcher.

A mistake in a dataset, a model folder or a reward function would otherwise surface inside
every replica, after N processes (or N paid containers) started, downloaded and built a
trainer; and being deterministic, it would surface again on every restart. So the plan reads
what is cheap to read here and refuses the launch in one line that names the fix:

- every row of each local split the run uses (training and held-out; of a split too large
  to read whole, its first rows), and a URL's or a reachable Hub dataset's first rows,
  streamed (crf/replica/data.py ``first_rows``; a Hub dataset's config and split are
  checked on the way), after the ``--column`` mapping: empty splits, null or non-text prompts,
  empty SFT texts, answers the chosen reward cannot read, columns that mix kinds; each
  reward function is called on a few of them (:data:`SAMPLE_ROWS`) and must return one
  finite number per row;
- a local ``--model`` folder's ``config.json``, tokenizer files and safetensors headers (a
  header's offsets against the file's size find a truncated download without loading a
  weight): a known ``model_type``, a tokenizer there, no more tokens than the model embeds,
  a chat template for conversational data and a pad (or EOS) token for batches; for the
  composer job, prompts rendered through that template and counted against the model's
  positions; for the sft job, conversations rendered through it (crf/launcher/prompt_checks.py);
- a Hub model or dataset, asked for with a short timeout: on the local backend the replicas
  use this machine's network, so one it cannot reach is refused; on a cloud backend the
  replicas may reach what the launcher cannot, so it is a warning (the plan's notes).

Configs, safetensors headers, tokenizers and rows are read; the model is built on the meta
device only (crf/launcher/model_shapes.py): no weights are loaded and nothing is written.
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from crf.launcher.errors import LaunchError
from crf.replica.time_limit import in_time

#: rows of each split read before launch (the rewards are called on them too)
SAMPLE_ROWS = 8
#: seconds the Hub may take to answer before it counts as unreachable
HUB_TIMEOUT_S = 4.0
#: seconds a Hub dataset's first rows may take to stream before the replicas are left to
#: check them (resolving the repo's files and reading the head of the first one)
HUB_ROWS_S = 60.0
#: files of which at least one makes a tokenizer (transformers' fast and slow formats)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model", "sentencepiece.bpe.model", "tokenizer_config.json")  # fmt: skip
#: a tokenizer this much smaller than the model's embedding may be another model's: warned
#: of, not refused (models pad their embedding past their tokenizer, a little as Qwen2.5's
#: 151936 rows for 151665 ids, or a lot: a small tokenizer padded to a round size)
FOREIGN_TOKENIZER_RATIO = 0.5
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


@dataclass
class Split:
    """The rows of one split the run reads, with the job's field names: a few to call the
    rewards on, and (a local split) every value, for the row rules."""

    flag: str  # the option that names it: --dataset, --eval-dataset, --eval-split
    dataset: str
    rows: list[dict[str, Any]] = field(default_factory=list)
    form: str | None = None  # the sft job's format (prompt-completion, conversational, ...)
    counted: int = 0  # the rows read (up to what check_batch needs; a local split's all)
    #: a local split's every value, by the job's field (check_rows reads them all); None:
    #: a URL's split, of which only ``rows`` were read
    every: dict[str, list[Any]] | None = None
    #: a local split too large to read whole: ``every`` holds its first rows only
    partial: bool = False
    #: a folder's data files of another format, which the replicas' reader skips
    unread: list[str] = field(default_factory=list)
    #: each row's line in its file (a JSON lines or CSV file read whole), for messages
    lines: list[int] | list[str] | None = None
    #: a CSV file's cells pandas read other than written, by the job's field: {row: text}
    #: of numbers with leading zeros, and of missing values (crf/replica/data_files.py)
    zeros: dict[str, dict[int, str]] = field(default_factory=dict)
    missing: dict[str, dict[int, str]] = field(default_factory=dict)


# ---------------------------------------------------------------------- entry point
@dataclass
class Found:
    """What the checks found that does not refuse the launch: ``warnings`` (a cloud
    backend's Hub repos this machine cannot reach, for the plan's notes) and ``missing``
    (a dry run on the local backend: a Hub repo it cannot reach, as missing access)."""

    warnings: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    #: the splits read, whose sampled rows the rewards are called on
    splits: list[Split] = field(default_factory=list)


def builtin_data(spec: Any) -> bool:
    """Whether the run's data and rewards are read by a built-in job (composer, sft), which
    these checks know; a custom job or entrypoint reads them its own way."""
    return not spec.entrypoint and spec.job in ("composer", "sft")


def check_inputs(spec: Any, *, local: bool, dry_run: bool = False) -> Found:
    """Every check of this module for a plan's ``spec``; LaunchError (one line) for the
    first problem. ``local``: the replicas run on this machine, so an unreachable Hub repo
    is refused (a dry run lists it with what is missing, as it lists credentials)."""
    found = Found()
    if not builtin_data(spec):
        return found  # a custom job or entrypoint reads its data its own way
    model = getattr(spec, "model", None)
    model = model and os.path.expanduser(model)  # "~/m" from a config file or quoted flag
    hub = _hub_datasets(spec)
    if model:
        if os.path.isdir(model) or not _is_hub_id(model) or os.path.lexists(model):
            found.warnings += check_model(model, spec)
        else:
            hub.insert(0, ("--model", model))
    unsampled: set[str] = set()  # Hub datasets whose rows are not read here
    for flag, name in hub:
        kind = "model" if flag == "--model" else "dataset"
        problem = hub_problem(name, kind, local=local)
        if problem is None:
            continue
        unsampled.add(name)
        parent = name.split("/", 1)[0]
        if kind == "dataset" and "/" in name and os.path.isdir(parent):
            problem = f"no such file or folder in {parent}/ here, and as a Hub id: {problem}"
        if local and not dry_run:
            raise LaunchError(f"{flag} {name}: {problem}")
        if local:
            found.missing.append(f"{flag} {name}: {problem}")
        else:
            found.warnings.append(
                f"{flag} {name}: not reached from this machine ({problem}); the "
                f"{spec.backend} replicas must reach it themselves"
            )
    splits = sample_splits(spec, unsampled, found.warnings)
    for split in splits:
        check_rows(spec, split)
        zeros = dropped_zeros(spec, split)
        if zeros:
            found.warnings.append(zeros)
        if split.unread:
            found.warnings.append(
                f"{split.flag} {split.dataset}: {', '.join(split.unread[:3])} not read (a "
                "folder is read in one format, its most common, and by lower-case suffixes, "
                "and not into linked folders, as datasets reads it); convert or rename such "
                "files, or move them out (a linked folder's: copy them in)"
            )
        if split.partial:
            found.warnings.append(
                f"{split.flag} {split.dataset}: its first {split.counted:,} rows were checked "
                "here (a split this large is not read whole); each replica checks its own "
                "rows when it starts"
            )
    check_batch(spec, splits)
    if not model:
        check_embedded_model(spec, splits)
    if model and os.path.isdir(model):
        check_tokenizer_for(
            model, splits,
            assistant_only=spec.job == "sft" and _trl_setting(spec, "assistant_only_loss"),
        )  # fmt: skip
        if spec.job == "composer":  # prompts through its template, within its positions
            found.warnings += _check_prompts(spec, model, splits)
        else:  # the sft job's sequences within its positions, conversations through its template
            from crf.launcher.prompt_checks import check_conversations

            found.warnings += check_sft_length(spec, model)
            remote = False  # the launcher never runs a repo's code (replicas do, when asked)
            check_conversations(model, splits, first=SAMPLE_ROWS, trust_remote_code=remote)
            found.warnings += _check_answers(spec, model, splits)
    if spec.job == "sft":  # prompts that leave no completion token within max_length
        found.warnings += sft_cut_prompts(spec, model, splits)
    found.splits = splits  # the rewards are called on their sampled rows next
    return found  # (crf/launcher/reward_checks.py)


def _check_prompts(spec: Any, model: str, splits: list[Split]) -> list[str]:
    from crf.launcher.prompt_checks import check_prompts
    from crf.replica.jobs import job_config
    from crf.replica.jobs.composer import completion_tokens

    remote = False  # the launcher never runs a repo's code (replicas do, when asked)
    new = completion_tokens(job_config("composer", spec.job_config), spec)
    return check_prompts(model, splits, first=SAMPLE_ROWS, trust_remote_code=remote, new_tokens=new)


def _check_answers(spec: Any, model: str, splits: list[Split]) -> list[str]:
    """The sft job's held-out answers within ``model``'s positions, when pass@1 is scored
    (``--reward``): crf/launcher/prompt_checks.py ``check_answer_positions``."""
    from crf.launcher.prompt_checks import check_answer_positions
    from crf.replica.jobs import job_config

    held = [s for s in splits if s.flag != "--dataset"]
    if not held or not getattr(spec, "reward", None):
        return []
    new = job_config("sft", spec.job_config).new_tokens(spec)
    remote = False  # the launcher never runs a repo's code (replicas do, when asked)
    return check_answer_positions(model, held, new, trust_remote_code=remote)


#: the first prompts of a split whose tokens :func:`sft_cut_prompts` counts
CUT_ROWS = 10_000


def sft_cut_prompts(spec: Any, model: str | None, splits: list[Split]) -> list[str]:
    """A warning for sampled prompt-completion rows whose prompt takes the sft job's whole
    ``max_length`` (TRL cuts each sequence there and drops a row with no completion token
    left to train on, without a word), among the first :data:`CUT_ROWS`; LaunchError when
    every one is such a row (no step would train). Counted with the model's tokenizer where
    it is on this machine, else estimated (crf/replica/trl_settings.py ``token_counter``)."""
    from crf.replica.jobs import job_config
    from crf.replica.trl_settings import token_counter

    lora = int(getattr(spec, "lora_rank", 0) or 0) > 0
    settings = job_config("sft", spec.job_config).settings(model=bool(model), lora=lora)
    length = int(settings["max_length"])
    out: list[str] = []
    for split in splits:
        every = (split.every or {}).get("prompt") or [r.get("prompt") for r in split.rows]
        prompts = [p for p in every[:CUT_ROWS] if isinstance(p, str)]
        if split.flag != "--dataset" or split.form != "prompt-completion" or not prompts:
            continue
        count, how = token_counter(model, False)  # never the repo's code here
        tokens = [count(p) for p in prompts]
        cut = sum(n >= length for n in tokens)
        where = f"{split.flag} {split.dataset}"
        fix = f"raise --set max_length above {max(tokens)} (the longest prompt; {how})"
        if cut == len(prompts):
            raise LaunchError(
                f"{where}: every prompt checked is max_length {length} tokens or longer, so "
                f"no row keeps a completion token to train on and TRL drops them all; {fix}"
            )
        if cut:
            out.append(
                f"{where}: {cut} of {len(prompts)} prompts checked are max_length {length} "
                f"tokens or longer: TRL drops such rows (no completion token left to train "
                f"on); {fix}, or shorten them"
            )
    return out


def check_sft_length(spec: Any, model: str) -> list[str]:
    """The sft job's ``max_length`` against ``model``'s positions. LaunchError past a
    learned position table (GPT-2's ``n_positions``): a sequence cut to max_length would
    still be longer than the table and fail in the first step, on every replica. A warning
    past the ``max_position_embeddings`` of a model without one (rotary): it trains on past
    them, on positions it was never trained at, usually worse."""
    from crf.launcher.model_shapes import learned_positions
    from crf.launcher.prompt_checks import config_positions
    from crf.replica.jobs import job_config
    from crf.replica.prompt_fit import max_length_past

    lora = int(getattr(spec, "lora_rank", 0) or 0) > 0
    length = job_config("sft", spec.job_config).settings(model=True, lora=lora)["max_length"]
    learned = learned_positions(model)
    if learned is not None:
        if length > learned:
            raise LaunchError(max_length_past(learned, model, length))
        return []
    limit = config_positions(model)
    if limit is None or length <= limit:
        return []
    return [
        f"--model {model} has {limit} positions (max_position_embeddings) but the sft job's "
        f"max_length is {length}: a longer sequence trains past them, on positions the model "
        f"was not trained at (it runs on, usually worse); --set max_length={limit} cuts "
        "sequences there"
    ]


# ---------------------------------------------------------------------- reachability
def _is_hub_id(name: str) -> bool:
    return bool(_HUB_ID.match(name)) and not name.startswith(".") and not os.path.exists(name)


def _hub_datasets(spec: Any) -> list[tuple[str, str]]:
    from crf.replica.data import builder_of, is_local_folder

    out = []
    for flag, name in (("--dataset", spec.dataset), ("--eval-dataset", spec.eval_dataset)):
        if name and builder_of(name) is None and not is_local_folder(name) and _is_hub_id(name):
            out.append((flag, name))
    return out


def hub_problem(name: str, kind: str, *, local: bool = True) -> str | None:
    """Why Hub repo ``name`` cannot be used from here (None: it answers, or is cached). A
    model in the local cache counts as reachable (``from_pretrained`` falls back to it
    offline). With ``HF_HUB_OFFLINE`` set, a cloud backend's repos are not asked for: the
    user said this machine stays off the network, and its replicas are elsewhere."""
    from huggingface_hub import HfApi, constants, try_to_load_from_cache
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    if kind == "model" and isinstance(try_to_load_from_cache(name, "config.json"), str):
        return None
    folder = f"{kind}s--{name.replace('/', '--')}"  # the Hub cache's folder of the repo
    if kind == "dataset" and os.path.isdir(os.path.join(constants.HF_HUB_CACHE, folder)):
        return None  # downloaded before: datasets reads it offline
    if constants.HF_HUB_OFFLINE:
        if not local:
            return None
        return (
            f"HF_HUB_OFFLINE is set and the {kind} is not in this machine's Hub cache: "
            "unset it, or download it first (or pass a local folder)"
        )
    try:
        HfApi(endpoint=constants.ENDPOINT).repo_info(name, repo_type=kind, timeout=HUB_TIMEOUT_S)
    except GatedRepoError:
        return f"the {kind} is gated: accept its terms on the Hub and set HF_TOKEN"
    except RepositoryNotFoundError:
        return (
            f"no such {kind} on the Hub {constants.ENDPOINT} (or it is private: set "
            "HF_TOKEN); check the name, or pass a local folder"
        )
    except Exception as e:  # noqa: BLE001 - connection refused, timeout, DNS, TLS...
        reason = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
        return (
            f"the Hub ({constants.ENDPOINT}) cannot be reached ({type(e).__name__}: "
            f"{reason}); check the network, or pass a local folder"
        )
    return None


# ---------------------------------------------------------------------- the model
def check_model(model: str, spec: Any) -> list[str]:
    """A local ``--model`` folder's files (:func:`check_model_folder`; its warnings are
    returned); a path that is no folder is refused, saying what it is (a file, a broken
    link)."""
    if os.path.isdir(model):
        remote = bool(getattr(spec, "trust_remote_code", 0))
        warnings = check_model_folder(model, trust_remote_code=remote)
        if int(getattr(spec, "lora_rank", 0) or 0) > 0:
            from crf.launcher.model_shapes import lora_problem

            problem = lora_problem(model, getattr(spec, "lora_target_modules", None))
            if problem:
                raise LaunchError(problem)
        return warnings
    if os.path.lexists(model):
        from crf.spec import model_path_problem

        raise LaunchError(model_path_problem(model))
    raise LaunchError(
        f"--model {model}: no such folder here, and not a Hub id (org/name); check the path"
    )


def _read_json(path: str, what: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LaunchError(f"{what} {path} cannot be read: {e}") from None
    if not isinstance(data, dict):
        raise LaunchError(f"{what} {path} holds no JSON object")
    return data


def _optional_json(path: str) -> dict[str, Any]:
    """A JSON object file's fields, or none when it is absent or unreadable (an optional
    file another check does not depend on)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def check_model_folder(folder: str, *, trust_remote_code: bool = False) -> list[str]:
    """config.json with a model_type transformers knows (or remote code allowed), tokenizer
    files, weights that are all there, and a tokenizer no larger than the embedding; returns
    the warnings (a tokenizer far smaller than the embedding: :func:`check_vocab`)."""
    flag = f"--model {folder}"
    config_path = os.path.join(folder, "config.json")
    if not os.path.isfile(config_path):
        adapter = os.path.join(folder, "adapter_config.json")
        if os.path.isfile(adapter):
            base = _read_json(adapter, f"{flag}:").get("base_model_name_or_path")
            raise LaunchError(
                f"{flag} is a LoRA adapter (of {base}), not a model: export it merged "
                "(crf export RUN DEST --merge) and pass DEST, or pass the base model"
            )
        raise LaunchError(f"{flag} has no config.json: is it a Hugging Face model folder?")
    config = _read_json(config_path, f"{flag}:")
    model_type = config.get("model_type")
    remote = trust_remote_code and "auto_map" in config
    if not remote and not known_model_type(model_type):
        raise LaunchError(
            f"{flag}: config.json's model_type {model_type!r} is unknown to this "
            "transformers; fix config.json, upgrade transformers, or pass "
            "--trust-remote-code for a model that ships its own code"
        )
    from crf.replica.model import kind_problem

    kind = None if remote else kind_problem(config)
    if kind:
        raise LaunchError(f"{flag} {kind}")
    names = set(os.listdir(folder))
    if not names & set(TOKENIZER_FILES):
        raise LaunchError(
            f"{flag} has no tokenizer files (tokenizer.json, tokenizer_config.json...): save "
            "the tokenizer there too (tokenizer.save_pretrained(folder))"
        )
    check_weights(folder, names)
    warnings = check_vocab(folder, config)
    if "auto_map" not in config:  # a model with its own code is not built here (that runs it)
        from crf.launcher.model_shapes import missing_weights, shape_problem, weight_files
        from crf.replica.model import missing_message

        shards = weight_files(folder, names)  # safetensors, else pytorch_model*.bin
        why = shape_problem(folder, shards)
        if why:
            raise LaunchError(f"{flag}: {why}; save the model and its config together again")
        missing = missing_weights(folder, shards)
        if missing:
            raise LaunchError(missing_message(folder, missing))
    return warnings


def known_model_type(model_type: Any) -> bool:
    """Whether transformers knows ``model_type``: its ``transformers/models/<type>`` folder is
    there (a directory lookup), else its auto mapping says so (an import that costs about a
    second on a busy machine, paid only for a type without a folder of its name)."""
    import importlib.util

    if not isinstance(model_type, str) or not model_type:
        return False
    spec = importlib.util.find_spec("transformers")
    if spec is not None and spec.origin:
        folder = os.path.join(os.path.dirname(spec.origin), "models", model_type.replace("-", "_"))
        if os.path.isfile(os.path.join(folder, f"configuration_{model_type.replace('-', '_')}.py")):
            return True
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return model_type in CONFIG_MAPPING_NAMES


def check_weights(folder: str, names: set[str]) -> None:
    """LaunchError when the weights are absent or a safetensors file is shorter than its
    header says (a cut download); reads each file's header only."""
    flag = f"--model {folder}"
    shards = sorted(n for n in names if n.endswith(".safetensors"))
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        listed = set(_read_json(index, f"{flag}:").get("weight_map", {}).values())
        absent = sorted(listed - names)
        if absent:
            raise LaunchError(
                f"{flag}: weight file(s) {', '.join(absent[:3])} named by "
                "model.safetensors.index.json are missing; download the model again"
            )
    if not shards and not any(n.endswith((".bin", ".pt", ".pth")) for n in names):
        raise LaunchError(
            f"{flag} has no weights (model.safetensors or pytorch_model.bin): save the "
            "model there (model.save_pretrained(folder))"
        )
    for name in shards:
        why = safetensors_problem(os.path.join(folder, name))
        if why:
            raise LaunchError(f"{flag}: {name} {why}; download or save the model again")
    if not shards:
        check_bin_weights(folder, names)


def check_bin_weights(folder: str, names: set[str]) -> None:
    """LaunchError for a checkpoint in torch's format (``pytorch_model*.bin``) whose index
    names a shard that is absent, or a shard that does not open (a cut download); its
    pickle is read memory-mapped onto the meta device, its tensor data is not."""
    from crf.launcher.model_shapes import BIN_INDEX, bin_shapes, weight_files

    flag = f"--model {folder}"
    if BIN_INDEX in names:
        listed = _read_json(os.path.join(folder, BIN_INDEX), f"{flag}:").get("weight_map", {})
        absent = sorted(set(listed.values()) - names) if isinstance(listed, dict) else []
        if absent:
            raise LaunchError(
                f"{flag}: weight file(s) {', '.join(absent[:3])} named by {BIN_INDEX} are "
                "missing; download the model again"
            )
    for name in weight_files(folder, names):
        try:
            bin_shapes(os.path.join(folder, name))
        except (OSError, ValueError) as e:
            raise LaunchError(f"{flag}: {name} {e}; download or save the model again") from None


def safetensors_problem(path: str) -> str | None:
    """Why a safetensors file is unusable, from its header alone (None: it is whole)."""
    size = os.path.getsize(path)
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return f"is truncated ({size} bytes)"
            (length,) = struct.unpack("<Q", head)
            if length > size - 8:
                return f"is truncated ({size} bytes, its header alone says {length + 8})"
            header = json.loads(f.read(length))
    except (OSError, ValueError) as e:
        return f"is not a safetensors file ({type(e).__name__})"
    end = max(
        (int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__"),
        default=0,
    )
    if 8 + length + end > size:
        return f"is truncated ({size} of {8 + length + end} bytes)"
    return None


def _embedding_size(config: Mapping[str, Any]) -> int | None:
    for where in (config, config.get("text_config") or {}):
        value = where.get("vocab_size") if isinstance(where, Mapping) else None
        if isinstance(value, int) and value > 0:
            return value
    return None


def tokenizer_size(folder: str) -> int | None:
    """The number of token ids of the folder's ``tokenizer.json`` (vocabulary and added
    tokens), or None when it has none (a slow tokenizer: not counted here)."""
    path = os.path.join(folder, "tokenizer.json")
    if not os.path.isfile(path):
        return None
    data = _read_json(path, f"--model {folder}:")
    vocab = (data.get("model") or {}).get("vocab")
    ids: set[int] = set()
    if isinstance(vocab, dict):
        ids |= {v for v in vocab.values() if isinstance(v, int)}
    elif isinstance(vocab, list):  # unigram: [[piece, score], ...]
        ids |= set(range(len(vocab)))
    ids |= {t["id"] for t in data.get("added_tokens") or [] if isinstance(t.get("id"), int)}
    return max(ids) + 1 if ids else None


def check_vocab(folder: str, config: Mapping[str, Any]) -> list[str]:
    """LaunchError when token ids can exceed the model's embedding (an index error on the
    first batch) or a ``pad_token_id`` is past it (every replica's setup fails: "Padding_idx
    must be within num_embeddings"): both are certain failures. A tokenizer far smaller than
    the embedding is returned as a warning: it may be another model's tokenizer (the wrong
    rows would train), but a checkpoint may also pad a small tokenizer's embedding to a
    round size, which trains fine, and the files cannot tell the two apart."""
    embed, tokens = _embedding_size(config), tokenizer_size(folder)
    if embed is None:
        return []
    for name in ("config.json", "generation_config.json"):
        path = os.path.join(folder, name)
        pad = (config if name == "config.json" else _optional_json(path)).get("pad_token_id")
        if isinstance(pad, int) and pad >= embed:
            raise LaunchError(
                f"--model {folder}: {name}'s pad_token_id {pad} is past the embedding "
                f"(vocab_size {embed}): set it to the tokenizer's pad id, or remove it"
            )
    if tokens is None:
        return []
    if tokens > embed:
        raise LaunchError(
            f"--model {folder}: its tokenizer has {tokens} token ids but the model embeds "
            f"{embed} (config.json vocab_size): ids past {embed - 1} would crash; save the "
            "model with model.resize_token_embeddings(len(tokenizer))"
        )
    if tokens < embed * FOREIGN_TOKENIZER_RATIO:
        return [
            f"--model {folder}: its tokenizer has {tokens} token ids but the model embeds "
            f"{embed} rows (config.json vocab_size): fine for an embedding padded past its "
            "tokenizer, but if the tokenizer is another model's, the run trains the wrong "
            "rows: save the model's own tokenizer there"
        ]
    return []


def tokenizer_settings(folder: str) -> dict[str, Any]:
    """The folder's tokenizer_config.json (with ``chat_template`` from chat_template.jinja /
    .json when saved apart, as transformers does now), {} without one."""
    path = os.path.join(folder, "tokenizer_config.json")
    out = _read_json(path, f"--model {folder}:") if os.path.isfile(path) else {}
    jinja = os.path.join(folder, "chat_template.jinja")
    if not out.get("chat_template") and os.path.isfile(jinja):
        out["chat_template"] = "(chat_template.jinja)"
    js = os.path.join(folder, "chat_template.json")
    if not out.get("chat_template") and os.path.isfile(js):
        out["chat_template"] = _read_json(js, f"--model {folder}:").get("chat_template")
    special = os.path.join(folder, "special_tokens_map.json")
    if os.path.isfile(special):
        for key, value in _read_json(special, f"--model {folder}:").items():
            out.setdefault(key, value)
    return out


def check_tokenizer_for(folder: str, splits: list[Split], *, assistant_only: bool = False) -> None:
    """The folder's tokenizer loads here as every replica loads it; a chat template when a
    split is conversational (one that marks the assistant's turns with ``{% generation %}``
    for ``assistant_only``: the sft job's ``trl.assistant_only_loss``); a pad token (or an
    EOS, which the replicas pad with) for batching, and an EOS, which generation stops on
    and SFT appends to every sequence. A tokenizer that ships its own code is not loaded
    here (the launcher never runs a repo's code, even with ``--trust-remote-code``): its
    replicas load it, and say what is wrong with it."""
    from crf.replica.model import load_local_tokenizer

    settings = tokenizer_settings(folder)
    chat = next((s for s in splits if _conversational(s)), None)
    if chat is not None and not settings.get("chat_template"):
        raise LaunchError(
            f"{chat.flag} {chat.dataset} holds conversations (lists of messages) but "
            f"--model {folder} has no chat template: add one to its tokenizer "
            "(tokenizer.chat_template = ...; save_pretrained), or use plain-text columns"
        )
    if not settings.get("pad_token") and not settings.get("eos_token"):
        if os.path.isfile(os.path.join(folder, "tokenizer_config.json")):
            raise LaunchError(
                f"--model {folder}: its tokenizer has no pad token and no EOS token to pad "
                "batches with; set tokenizer.pad_token and save_pretrained the folder"
            )
    if own_tokenizer_code(folder):
        return
    tokenizer, why = load_local_tokenizer(folder, trust_remote_code=False)
    if tokenizer is None:
        raise LaunchError(
            f"--model {folder}: its tokenizer does not load ({why}): save a fast tokenizer "
            "(tokenizer.json) with save_pretrained, or install sentencepiece"
        )
    if getattr(tokenizer, "eos_token", None) is None:
        raise LaunchError(
            f"--model {folder}: its tokenizer has no EOS token, which generation stops on and "
            "SFT appends; set tokenizer.eos_token and save_pretrained"
        )
    if assistant_only and chat is not None:
        check_assistant_markers(folder, tokenizer)


def own_tokenizer_code(folder: str) -> bool:
    """Whether ``folder``'s tokenizer is a class of the repo's own code: an ``AutoTokenizer``
    entry in the ``auto_map`` of tokenizer_config.json or config.json."""
    for name in ("tokenizer_config.json", "config.json"):
        auto_map = _optional_json(os.path.join(folder, name)).get("auto_map")
        if isinstance(auto_map, dict) and auto_map.get("AutoTokenizer"):
            return True
        if isinstance(auto_map, list) and name == "tokenizer_config.json" and auto_map:
            return True  # transformers' older form: [slow class, fast class]
    return False


def check_assistant_markers(folder: str, tokenizer: Any) -> None:
    """LaunchError when TRL's SFTTrainer would refuse ``tokenizer``'s chat template for
    ``assistant_only_loss`` at every replica's setup: no ``{% generation %}`` markers and
    not a template TRL knows how to patch (its own check, ``get_training_chat_template``)."""
    from trl.chat_template_utils import get_training_chat_template, has_generation_markers

    if has_generation_markers(tokenizer.chat_template):
        return
    try:
        get_training_chat_template(tokenizer)
    except ValueError:
        raise LaunchError(
            "trl.assistant_only_loss needs a chat template that marks the assistant's turns "
            f"with {{% generation %}} ... {{% endgeneration %}}, and --model {folder}'s has "
            "none TRL can add: add the markers to its chat template (save_pretrained), or "
            "leave trl.assistant_only_loss off"
        ) from None


def _trl_setting(spec: Any, name: str) -> bool:
    """Whether the run's ``trl`` table sets ``name`` on (``--set trl.NAME=...``,
    ``[job.trl]``), as the job reads it."""
    from crf.replica.jobs import job_config

    try:
        return bool(job_config(spec.job, spec.job_config).trl.get(name))
    except (TypeError, ValueError):  # refused with its own line before the data is read
        return False


def check_embedded_model(spec: Any, splits: list[Split]) -> None:
    """Without ``--model`` the composer job trains its embedded character model, which has
    no chat template: conversational prompts would fail at every replica's first step."""
    chat = next((s for s in splits if _conversational(s)), None)
    if spec.job == "composer" and chat is not None:
        raise LaunchError(
            f"{chat.flag} {chat.dataset} holds conversations (lists of messages) but the "
            "composer job's embedded model has no chat template: pass --model with one, or "
            "give the prompts as text"
        )


def _conversational(split: Split) -> bool:
    if split.form == "conversational":
        return True
    return any(isinstance(r.get("prompt"), list) for r in split.rows)


# ---------------------------------------------------------------------- the rows
def sample_splits(spec: Any, unsampled: set[str], warnings: list[str]) -> list[Split]:
    """The rows of every split the run reads, with the job's field names: a local file or
    folder whole (its every value, for :func:`check_rows`), a URL's or a Hub dataset's first
    rows, streamed (the replicas download the rest). A Hub dataset in ``unsampled`` (not
    reached from here) is left to the replicas, as is one with ``HF_HUB_OFFLINE`` set, one
    whose first rows take longer than :data:`HUB_ROWS_S` and one they cannot be streamed from
    for a reason no option names (a line of ``warnings`` says so)."""
    from huggingface_hub import constants

    from crf.replica.data import NotStreamed, eval_source

    sources = []
    if spec.dataset:
        sources.append(("--dataset", spec.dataset, spec.dataset_config, spec.dataset_split))
    held = eval_source(spec)
    if held is not None:
        flag = "--eval-dataset" if spec.eval_dataset else "--eval-split"
        sources.append((flag, *held))
    out = []
    for flag, name, config, split in sources:
        if not _is_hub_dataset(name):
            out.append(_sample(spec, flag, name, config, split))
        elif name not in unsampled and not constants.HF_HUB_OFFLINE:
            try:
                sample = in_time(partial(_sample, spec, flag, name, config, split), HUB_ROWS_S)
            except NotStreamed as e:
                warnings.append(
                    f"{e}: its first rows could not be streamed here, so they were not "
                    "checked; each replica downloads the split and checks its own rows"
                )
                continue
            if sample is None:
                warnings.append(
                    f"{flag} {name}: its first rows did not arrive within {HUB_ROWS_S:g}s, "
                    "so they were not checked here; each replica checks its own rows when "
                    "it starts"
                )
            else:
                out.append(sample)
    return out


def _is_hub_dataset(name: str) -> bool:
    from crf.replica.data import builder_of, is_local_folder

    return builder_of(name) is None and not is_local_folder(name)


def _wanted(spec: Any, flag: str) -> int:
    """Rows to read of a split: the sample, and (the composer's training split) one batch of
    prompts per replica, counted for :func:`check_batch`."""
    if spec.job != "composer" or flag != "--dataset":
        return SAMPLE_ROWS
    from crf.replica.jobs import job_config

    per_step = int(job_config(spec.job, spec.job_config).prompts_per_step)
    return max(SAMPLE_ROWS, int(spec.replicas) * per_step)


def _sample(spec: Any, flag: str, name: str, config: str | None, split: str) -> Split:
    from crf.replica.data import (
        FIELDS,
        DataError,
        NotStreamed,
        field_columns,
        first_rows,
        is_local,
        kept_columns,
        needs_answer,
        read_error,
        required_fields,
    )

    try:
        first, names, counted, every = first_rows(name, config, split, _wanted(spec, flag), flag)
    except NotStreamed:
        raise  # not the options' fault: sample_splits warns
    except DataError as e:
        raise LaunchError(str(e)) from None
    except Exception as e:  # noqa: BLE001 - checked readable before; any reader error
        raise LaunchError(str(read_error(name, flag, e))) from None
    if not first:
        raise LaunchError(f"{flag} {name} has no rows: give a split with data")
    if any(not isinstance(r, dict) for r in first):
        raise LaunchError(f"{flag} {name}: every line must be a JSON object (a row)")
    raw = first[:SAMPLE_ROWS]
    columns = dict(spec.columns)
    if spec.job == "sft":
        from crf.replica.sft_data import check_scorable, other_columns, sft_format

        try:
            form, renames = sft_format(names, columns, name)
            if flag != "--dataset" and spec.reward:  # held-out rows the rewards score
                needs = ("prompt", *(("answer",) if needs_answer(spec) else ()))
                check_scorable(name, form, names, columns, needs, flag)
        except ValueError as e:
            raise LaunchError(str(e)) from None
        answer = columns.get("answer", "answer")
        # a held-out row reaches the rewards with every other column (sft._scorable)
        scored = {**renames, answer: "answer"} if answer in names else dict(renames)
        others = other_columns(scored, names) if flag != "--dataset" else {}
        rows = []
        for row in raw:
            mapped = {f: row.get(c) for c, f in renames.items()}
            if answer in row:
                mapped["answer"] = row[answer]
            mapped.update({k: row[c] for c, k in others.items() if c in row})
            rows.append(mapped)
        values = None
        if every is not None:
            values = {f: every.column(c) for c, f in renames.items()}
            if answer in every.names:
                values["answer"] = every.column(answer)
        read_as_json(spec, every, list(others), f"{flag} {name}")
        unread = list(getattr(every, "unread", []))
        split = Split(flag, name, rows, form, counted, values, _partial(every), unread)
        pairs = [*renames.items(), *([(answer, "answer")] if answer in names else [])]
        return _as_written(split, every, pairs)
    if not is_local(name):  # a URL's or Hub dataset's columns (a local one's: plan.py)
        try:
            field_columns(columns, names, name, required_fields(needs_answer(spec)), flag)
        except DataError as e:
            raise LaunchError(str(e)) from None
    present = [f for f in FIELDS if columns.get(f, f) in names]
    # the job's fields, and every column under its own name (the rewards get them all)
    keep = kept_columns([(columns.get(f, f), f) for f in present], names)
    rows = [{k: row[c] for c, k in keep if c in row} for row in raw]
    values = None
    if every is not None:
        values = {f: every.column(columns.get(f, f)) for f in present}
    fields = {columns.get(f, f) for f in present}
    read_as_json(spec, every, [c for c, k in keep if c == k and c not in fields], f"{flag} {name}")
    unread = list(getattr(every, "unread", []))
    split = Split(flag, name, rows, None, counted, values, _partial(every), unread)
    return _as_written(split, every, [(columns.get(f, f), f) for f in present])


def read_as_json(spec: Any, every: Any, names: list[str], where: str) -> None:
    """LaunchError, when a ``--reward`` is the user's own function, for a column that only
    the rewards read (``names``; the built-in rewards read none of them) holding text beside
    numbers or other kinds, where a text value reads as JSON (``"00074"``, ``"true"``): the
    replicas' reader (``datasets``) holds such a column as JSON, and a text that parses as
    JSON comes back parsed (74), so the rewards would get other values than the file's (and
    than the checks here). Text beside objects that is no JSON (``"n/a"``) comes back as
    written."""
    from datasets.utils.json import ujson_loads

    from crf.replica.data import kind_of, row_name
    from crf.replica.rewards import BUILTINS, parse_rewards

    if every is None or all(s.name in BUILTINS for s in parse_rewards(list(spec.reward or []))):
        return
    for column in names:
        values = every.column(column)
        kinds = {kind_of(v) for v in values if v is not None}
        if "text" not in kinds or len(kinds) < 2:
            continue
        for i, value in enumerate(values):
            if not isinstance(value, str):
                continue
            try:
                read = ujson_loads(value)
            except ValueError:
                continue
            j = next(j for j, v in enumerate(values) if v is not None and not isinstance(v, str))
            lines = every.lines
            raise LaunchError(
                f"{where}: column {column!r} mixes text ({row_name(i, lines)}: {value!r}) and "
                f"other kinds ({row_name(j, lines)}: {values[j]!r}), and the replicas' reader "
                f"(datasets) holds such a column as JSON, so the text {value!r} would reach the "
                f"rewards as {read!r}: make every value of it text (e.g. {str(values[j])!r}), "
                "or every value a number"
            )


def _as_written(split: Split, every: Any, pairs: list[tuple[str, str]]) -> Split:
    """``split`` with each row's line in its file, and its CSV cells read other than
    written (``every``'s, by column), by the job's field (``pairs``: column, field)."""
    split.lines = getattr(every, "lines", None)
    for column, fld in pairs:
        if column in getattr(every, "zeros", {}):
            split.zeros[fld] = every.zeros[column]
        if column in getattr(every, "missing", {}):
            split.missing[fld] = every.missing[column]
    return split


def _partial(every: Any) -> bool:
    return bool(getattr(every, "partial", False))


def dropped_zeros(spec: Any, split: Split) -> str | None:
    """A warning when a CSV's answer column, which a reward compares as text, holds numbers
    written with leading zeros (``0007``): pandas (``datasets``' CSV reader, in every
    replica too) reads them as numbers, so the reward compares against ``7``."""
    from crf.replica.data import DEFAULT_READER, answer_reader, row_name

    cells = split.zeros.get("answer")
    scored = spec.job == "composer" or (split.flag != "--dataset" and bool(spec.reward))
    reader = answer_reader(spec) if scored else None
    if not cells or reader in (None, "math_answer") or split.every is None:
        return None  # math_answer compares numbers: 0007 is 7
    i, text = next(iter(cells.items()))
    read = split.every["answer"][i]
    by = "the default reward" if reader == DEFAULT_READER else f"--reward {reader}"
    return (
        f"{split.flag} {split.dataset}: the answer column {shown_column(spec, 'answer')} holds "
        f"numbers written with leading zeros ({text!r} on {row_name(i, split.lines)} is read "
        f"as {read!r}; {len(cells)} such row(s)), which pandas, reading a CSV, drops, so {by} "
        f"compares answers against {str(read)!r}; to keep them as text, convert the file to "
        "JSON lines: pandas.read_csv(path, dtype=str, keep_default_na=False).to_json("
        '"train.jsonl", orient="records", lines=True)'
    )


def check_batch(spec: Any, splits: list[Split]) -> None:
    """The composer job: every replica's share of --dataset holds at least one batch of
    prompts (``prompts_per_step``). GRPO's sampler keeps only whole batches, so a smaller
    share trains no step at all (the sample counted up to replicas x prompts_per_step)."""
    from crf.replica.jobs import job_config

    train = next((s for s in splits if s.flag == "--dataset"), None)
    if spec.job != "composer" or train is None:
        return
    per_step = int(job_config(spec.job, spec.job_config).prompts_per_step)
    need = int(spec.replicas) * per_step
    rows = train.counted
    if rows < need:
        fits = max(1, rows // int(spec.replicas))
        raise LaunchError(
            f"--dataset {spec.dataset} has {rows} row(s): each of {spec.replicas} replicas "
            f"gets fewer than one batch of {per_step} prompts (prompts_per_step), and GRPO "
            f"trains on whole batches only; add rows, lower --replicas, or --set "
            f"prompts_per_step={fits}"
        )


def shown_column(spec: Any, fld: str) -> str:
    from crf.replica.data import column_of

    return column_of(dict(spec.columns), fld)


def value_kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def check_rows(spec: Any, split: Split) -> None:
    """The split's values, on every row of a local one (the sampled rows of a URL's), by the
    rules each replica applies to its own rows (crf/replica/data.py ``check_values``,
    crf/replica/sft_data.py ``check_rows``): a prompt that is text (or messages), SFT text
    that is not empty, (composer) an answer the reward that reads one can use, and no
    column that mixes kinds (text here, a number there)."""
    from crf.replica.data import DataError, answer_reader, check_values
    from crf.replica.sft_data import check_rows as check_sft_rows

    where = f"{split.flag} {split.dataset}"
    values = dict(split.every or {})
    if split.every is None:
        values = {f: [r.get(f) for r in split.rows] for f in {k for r in split.rows for k in r}}
    columns = dict(spec.columns)
    try:
        if spec.job == "sft" and split.form is not None:
            answers = values.pop("answer", None)
            flag = split.flag
            check_sft_rows(values, split.form, split.dataset, columns, flag, split.lines)
            scored = split.flag != "--dataset" and bool(spec.reward)  # sft._rows reads them
            if answers is not None and scored:  # held-out answers a reward scores against
                reader = answer_reader(spec)
                check_values({"answer": answers}, columns, where, reader=reader,
                             lines=split.lines, missing=split.missing)  # fmt: skip
            return
        scored = spec.job == "composer" or split.flag != "--dataset"
        reader = answer_reader(spec) if scored else None
        check_values(values, columns, where, reader=reader, lines=split.lines,
                     missing=split.missing)  # fmt: skip
    except DataError as e:
        raise LaunchError(str(e)) from None


# ---------------------------------------------------------------------- the rewards
