"""Model registry: log the policy, register a version, compare it with the champion, set aliases.

A version is promoted by comparing per-item eval results with the current ``@champion`` on the
same items (paired, exact McNemar), not by comparing two accuracies: on a few hundred items a
1-2 point gain is usually noise. Aliases: the first version becomes ``champion``; a promoted
version becomes ``champion`` and the old one ``previous-champion``; otherwise ``challenger``.

The model is an MLflow pyfunc (``served_model.py``) that wraps the Hugging Face directory and
decodes greedily, so ``mlflow.pyfunc.load_model("models:/grpo-smollm2@champion")`` works without
grpo_core installed. Per-item results live on the run as ``eval/items_<set>.json``.

    python -m grpo_core.tracking.registry compare grpo-smollm2 [--a 3 --b 4] [--tracking-uri URI]

The CLI reads the store ``--tracking-uri`` names, else ``$MLFLOW_TRACKING_URI``, else the local
default's sqlite store under ``<project>/.grpo/mlflow`` (where ``python flows/grpo_flow.py run``
writes). A missing store or an unknown model name is a one-line error; the latter lists the
registered models.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from grpo_core.evaluation.stats import accuracy, mcnemar_exact, wilson_interval
from grpo_core.io.paths import PROJECT_DIR
from grpo_core.tracking.runs import clean_tags, env_defaults, mlflow_client, resolve_tracking_uri, sqlite_path
from grpo_core.tracking.served_model import DEFAULT_MAX_NEW_TOKENS, QUIET, log_pyfunc_model, use_uri

RULES = ("significant", "better", "always")
MAX_DECISIONS = 3  # decisions re-taken when concurrent registrations keep moving @champion


# ---------------------------------------------------------------- pure decision logic


def align_by_id(a_items: list[dict], b_items: list[dict]) -> tuple[list[str], list[bool], list[bool]]:
    """Pair two result lists on the item ids they share (sorted, so output is deterministic)."""
    a = {str(r["item_id"]): bool(r["correct"]) for r in a_items}
    b = {str(r["item_id"]): bool(r["correct"]) for r in b_items}
    ids = sorted(a.keys() & b.keys())
    return ids, [a[i] for i in ids], [b[i] for i in ids]


def eval_summary(items: list[dict]) -> dict:
    """Accuracy, its Wilson 95% interval and n for one eval set."""
    k, n = sum(1 for r in items if r["correct"]), len(items)
    low, high = wilson_interval(k, n)
    return {"accuracy": k / n if n else 0.0, "ci_low": low, "ci_high": high, "n": n}


def decide_promotion(new_items: list[dict], champion_items: list[dict] | None,
                     rule: str = "significant", alpha: float = 0.05) -> dict:
    """Decide whether the new model replaces the champion, on their shared items.

    Accuracies are over the compared items only, so both models are scored on the same set.
    No champion -> "first". No shared items -> "challenger" unless the rule is "always".
    """
    if rule not in RULES:
        raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
    if champion_items is None:
        return {"decision": "first", "p_value": None, "champion_accuracy": None,
                "challenger_accuracy": accuracy([bool(r["correct"]) for r in new_items]),
                "compared_items": 0, "reason": "no champion yet"}
    _, new, old = align_by_id(new_items, champion_items)
    test = mcnemar_exact(new, old)
    acc_new, acc_old = accuracy(new), accuracy(old)
    if not new:
        promote, reason = rule == "always", "no item ids in common with the champion"
    elif rule == "always":
        promote, reason = True, "rule 'always'"
    elif rule == "better":
        promote, reason = acc_new > acc_old, f"accuracy {acc_new:.4f} vs {acc_old:.4f}"
    else:
        promote = acc_new > acc_old and test["p_value"] < alpha
        reason = f"accuracy {acc_new:.4f} vs {acc_old:.4f}, McNemar p={test['p_value']:.4g} (alpha {alpha})"
    return {"decision": "promoted" if promote else "challenger", "p_value": test["p_value"],
            "champion_accuracy": acc_old if new else None, "challenger_accuracy": acc_new if new else None,
            "compared_items": len(new), "a_only": test["a_only"], "b_only": test["b_only"], "reason": reason}


# ---------------------------------------------------------------- MLflow plumbing


def load_eval_items(client, run_id: str, eval_set: str) -> list[dict] | None:
    """The per-item results a run logged for ``eval_set``, or None if it has none."""
    name = f"eval/items_{eval_set}.json"
    if name not in {f.path for f in client.list_artifacts(run_id, "eval")}:
        return None  # listing first: a download error must not pass for "no results"
    with tempfile.TemporaryDirectory() as tmp, env_defaults(**QUIET):
        return json.loads(Path(client.download_artifacts(run_id, name, tmp)).read_text())


def aliases_by_version(client, name: str) -> dict[int, list[str]]:
    """version -> aliases (versions are int over sqlite and str over REST: normalise)."""
    out: dict[int, list[str]] = {}
    for alias, version in client.get_registered_model(name).aliases.items():
        out.setdefault(int(version), []).append(alias)
    return out


def _champion(client, name: str):
    """The ``@champion`` version or None; a missing alias raises INVALID_PARAMETER_VALUE, so check first."""
    if "champion" not in client.get_registered_model(name).aliases:
        return None
    return client.get_model_version_by_alias(name, "champion")


def _find_or_create_version(client, uri, name, run_id, model_dir, eval_items, tags, max_new_tokens,
                            system_prompt=None):
    """One version per run: a rerun of the register step reuses the version it made."""
    from mlflow.exceptions import MlflowException

    try:
        client.get_registered_model(name)
    except MlflowException:
        client.create_registered_model(name)
    existing = client.search_model_versions(f"name='{name}' and run_id='{run_id}'")
    if existing:
        return existing[0]
    for eval_set, items in eval_items.items():
        client.log_dict(run_id, items, f"eval/items_{eval_set}.json")
    info = log_pyfunc_model(uri, run_id, model_dir, max_new_tokens, system_prompt)
    with use_uri(uri):  # the sqlite registry resolves models:/m-... via the global URI
        return client.create_model_version(name, source=info.model_uri, run_id=run_id,
                                           tags=clean_tags(tags), model_id=info.model_id)


# ---------------------------------------------------------------- the register step


def register_model(uri: str, run_id: str, model_dir: str, name: str = "grpo-gsm8k", *,
                   eval_items: dict[str, list[dict]], primary: str = "gsm8k_test",
                   tags: dict | None = None, rule: str = "significant", alpha: float = 0.05,
                   max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, system_prompt: str | None = None,
                   baseline_items: list[dict] | None = None) -> dict:
    """Log, register, compare with ``@champion`` on ``primary`` and set aliases. Returns the
    decision dict, which names the set it compared on (``eval_set``). ``max_new_tokens`` and
    ``system_prompt``: the generation cap and system message of the evaluation that measured the
    model, so serving answers the same way. ``baseline_items``: the per-item results on ``primary``
    of the model the run started from; with no champion yet, the version must beat it by the same
    rule to become champion (without them the first version becomes champion unconditionally).

    The decision is stored as version tags *before* aliases are moved, so a rerun (e.g. a
    resumed Metaflow step) re-applies the same aliases instead of comparing the version with
    itself.
    """
    if primary not in eval_items:
        raise ValueError(f"primary eval set {primary!r} not in eval_items {sorted(eval_items)}")
    client = mlflow_client(uri)
    mv = _find_or_create_version(client, uri, name, run_id, model_dir, eval_items, tags, max_new_tokens,
                                 system_prompt)
    version = int(mv.version)
    superseded_by = None
    if "decision" in mv.tags:
        result = json.loads(mv.tags["grpo.decision_json"])
        champ = _champion(client, name)
        if (result["decision"] in ("first", "promoted") and champ is not None
                and int(champ.version) not in (version, result.get("champion_version"))):
            superseded_by = int(champ.version)
    else:
        digest = (tags or {}).get(f"dataset.{primary}.digest")
        for _ in range(MAX_DECISIONS):
            result = _decide_against_champion(client, name, eval_items[primary], primary, rule, alpha, digest,
                                              baseline_items)
            result.update(version=version, model_name=name, rule=rule, eval_set=primary)
            _tag_version(client, name, version, eval_items, result)
            champ = _champion(client, name)  # another registration may have moved it meanwhile:
            if (None if champ is None else int(champ.version)) == result["champion_version"]:
                break  # decide again, against the version this one would replace
        else:  # @champion kept moving: never promote on a comparison with a stale champion
            result.update(decision="challenger", reason=f"@champion moved during each of {MAX_DECISIONS} "
                          "decisions (concurrent registrations); not promoted, compare again later")
            _tag_version(client, name, version, eval_items, result)
    if superseded_by is None:
        _apply_aliases(client, name, version, result)
    else:  # re-applying the stored decision would take champion back without a comparison
        print(f"[registry] {name} v{version}: its stored decision ({result['decision']}) is not re-applied: "
              f"v{superseded_by} became champion since", file=sys.stderr)
    _log_to_run(client, run_id, eval_items, result)
    print(f"[registry] {name} v{version}: {result['decision']} ({result['reason']}; "
          f"{result['compared_items']} items of {result.get('eval_set', primary)} compared)", file=sys.stderr)
    return result


def _decide_against_champion(client, name, new_items, primary, rule, alpha, digest=None, baseline=None) -> dict:
    """``decide_promotion`` against the champion's logged per-item results on ``primary``. Items
    pair by id, and GSM8K ids are positions in the split: a champion evaluated on other data
    (its ``dataset.<primary>.digest`` tag differs from ``digest``) shares no comparable item.
    With no champion, against ``baseline`` (the start model's results) when given."""
    champ = _champion(client, name)
    if champ is None and baseline is not None:
        result = decide_promotion(new_items, baseline, rule, alpha)
        result["reason"] = f"no champion yet; against the start model: {result['reason']}"
        return {**result, "champion_version": None, "compared_with": "start model"}
    if champ is None:
        return {**decide_promotion(new_items, None, rule, alpha), "champion_version": None}
    theirs = champ.tags.get(f"dataset.{primary}.digest")
    other_data = digest is not None and theirs is not None and theirs != digest
    old = None if other_data else load_eval_items(client, champ.run_id, primary)
    result = decide_promotion(new_items, old or [], rule, alpha)
    if other_data:
        result["reason"] = (f"champion v{champ.version} was evaluated on other {primary} data (digest "
                            f"{theirs[:12]}, this version {digest[:12]}): no comparable items")
    elif old is None:
        result["reason"] = f"champion v{champ.version} has no eval/items_{primary}.json"
    return {**result, "champion_version": int(champ.version)}


def _tag_version(client, name: str, version: int, eval_items: dict, result: dict) -> None:
    tags = {}
    for eval_set, items in eval_items.items():
        tags.update({f"eval.{eval_set}.{k}": v for k, v in eval_summary(items).items()})
    keys = ("eval_set", "p_value", "champion_accuracy", "challenger_accuracy", "compared_items", "rule", "reason")
    tags.update({k: "" if result[k] is None else result[k] for k in keys})
    tags["grpo.decision_json"] = json.dumps(result)
    tags["decision"] = result["decision"]  # last: its presence marks the decision as stored
    for k, v in tags.items():
        client.set_model_version_tag(name, str(version), k, str(v))


def _apply_aliases(client, name: str, version: int, result: dict) -> None:
    """Idempotent alias moves for the stored decision."""
    if result["decision"] == "challenger":
        client.set_registered_model_alias(name, "challenger", str(version))
        return
    old = result.get("champion_version")
    if result["decision"] == "promoted" and old is not None and old != version:
        client.set_registered_model_alias(name, "previous-champion", str(old))
    client.set_registered_model_alias(name, "champion", str(version))


def _log_to_run(client, run_id: str, eval_items: dict, result: dict) -> None:
    from mlflow.entities import Metric, RunTag

    metrics = {f"eval.{s}.{k}": v for s, items in eval_items.items()
               for k, v in eval_summary(items).items()}
    metrics.update({f"promotion.{k}": result[k] for k in
                    ("p_value", "champion_accuracy", "challenger_accuracy", "compared_items")})
    tags = {"promotion.decision": result["decision"], "promotion.reason": result["reason"],
            "promotion.eval_set": str(result.get("eval_set", "")),
            "registry.model": result["model_name"], "registry.version": str(result["version"])}
    held = client.get_run(run_id).data.metrics  # a rerun of the step (resume) logs no second point
    now = int(time.time() * 1000)
    client.log_batch(run_id, metrics=[Metric(k, float(v), now, 0) for k, v in metrics.items()
                                      if v is not None and k not in held],
                     tags=[RunTag(k, v) for k, v in tags.items()])


# ---------------------------------------------------------------- CLI


def _fmt_acc(tags: dict, eval_set: str) -> str:
    acc = tags.get(f"eval.{eval_set}.accuracy")
    if acc is None:
        return "-"
    low, high = tags.get(f"eval.{eval_set}.ci_low"), tags.get(f"eval.{eval_set}.ci_high")
    return f"{float(acc):.3f} [{float(low):.3f},{float(high):.3f}]"


def print_versions(client, name: str) -> None:
    """One row per version: aliases, accuracy [95% CI] per eval set, digests, provenance."""
    versions = sorted(client.search_model_versions(f"name='{name}'"), key=lambda v: int(v.version))
    aliases = aliases_by_version(client, name)
    sets = sorted({k.split(".")[1] for v in versions for k in v.tags
                   if k.startswith("eval.") and k.endswith(".accuracy")})
    header = ["version", "aliases", *sets, "decision", "digests", "run_id", "pathspec"]
    rows = []
    for v in versions:
        digests = ",".join(f"{k}={t[:12]}" for k, t in sorted(v.tags.items()) if "digest" in k)
        pathspec = next((t for k, t in v.tags.items() if "pathspec" in k), "-")
        rows.append([str(v.version), ",".join(sorted(aliases.get(int(v.version), []))) or "-",
                     *[_fmt_acc(v.tags, s) for s in sets], v.tags.get("decision", "-"),
                     digests or "-", v.run_id or "-", pathspec])
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip())


def _eval_sets(client, run_id: str) -> set[str]:
    files = client.list_artifacts(run_id, "eval")
    return {Path(f.path).stem.removeprefix("items_") for f in files if f.path.endswith(".json")}


def print_pair(client, name: str, a: int, b: int, eval_set: str | None = None, show: int = 20) -> None:
    """Item-by-item paired comparison of two versions on each eval set both have."""
    va, vb = client.get_model_version(name, str(a)), client.get_model_version(name, str(b))
    sets = [eval_set] if eval_set else sorted(_eval_sets(client, va.run_id) & _eval_sets(client, vb.run_id))
    for s in sets:
        ia, ib = load_eval_items(client, va.run_id, s), load_eval_items(client, vb.run_id, s)
        if ia is None or ib is None:
            print(f"\n{s}: missing per-item results for v{a if ia is None else b}")
            continue
        ids, ra, rb = align_by_id(ia, ib)
        t = mcnemar_exact(ra, rb)
        print(f"\n{s}: {len(ids)} shared items  acc v{a}={accuracy(ra):.3f}  v{b}={accuracy(rb):.3f}")
        print(f"  a_only={t['a_only']}  b_only={t['b_only']}  both={t['both']}  "
              f"neither={t['neither']}  McNemar exact p={t['p_value']:.4g}")
        diff = [(i, x, y) for i, x, y in zip(ids, ra, rb) if x != y]
        for i, x, y in diff[:show]:
            print(f"  {i}: v{a}={'right' if x else 'wrong'}  v{b}={'right' if y else 'wrong'}")
        if len(diff) > show:
            print(f"  ... {len(diff) - show} more differing items")


def cli_tracking_uri(given: str | None) -> str:
    """``--tracking-uri``, else $MLFLOW_TRACKING_URI, else the local default's store, as the flow
    resolves it; a sqlite store that does not exist is an error, not a new empty db."""
    uri = given or resolve_tracking_uri(None, str(PROJECT_DIR))
    db = sqlite_path(uri)
    if db is not None and not db.is_file():
        raise SystemExit(f"python -m grpo_core.tracking.registry: error: no MLflow store at {db} (the local default's, "
                         "written by `python flows/grpo_flow.py run`): run the flow first, or give --tracking-uri "
                         "or set MLFLOW_TRACKING_URI")
    return uri


def require_registered(client, name: str, uri: str) -> None:
    """Stop with one line naming the registered models when ``name`` is not one of them."""
    names = sorted(m.name for m in client.search_registered_models())
    if name not in names:
        raise SystemExit(f"python -m grpo_core.tracking.registry: error: no registered model {name!r} in {uri}; "
                         f"registered: {', '.join(names) or 'none yet'}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m grpo_core.tracking.registry", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("compare", help="table of versions; with --a/--b a paired comparison")
    c.add_argument("name", help="registered model name, e.g. grpo-smollm2 (the local default's)")
    c.add_argument("--a", type=int, help="first version of the paired comparison")
    c.add_argument("--b", type=int, help="second version of the paired comparison")
    c.add_argument("--set", dest="eval_set", help="eval set to compare (default: all shared)")
    c.add_argument("--tracking-uri", default=None,
                   help="default: $MLFLOW_TRACKING_URI, else the local default's .grpo/mlflow/mlflow.db")
    args = p.parse_args(argv)
    if (args.a is None) != (args.b is None):
        p.error("--a and --b go together")
    uri = cli_tracking_uri(args.tracking_uri)
    client = mlflow_client(uri)
    require_registered(client, args.name, uri)
    print_versions(client, args.name)
    if args.a is not None:
        print_pair(client, args.name, args.a, args.b, args.eval_set)
    return 0


if __name__ == "__main__":
    sys.exit(main())
