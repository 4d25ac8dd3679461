"""Who may restore a capsule: its signatures and provenance against the restore policy (coldsnap.contracts.trust).

A digest pin proves which bytes; it does not say who made them. Trust comes from signatures: this host signs what
it captures with its own key (coldsnap.capsule.signing) and always trusts that key; a policy names more keys per
capsule name. A capsule pulled from a registry must verify against a trusted key unless the policy says otherwise;
a capsule captured here restores as it is unless the policy asks for a signature. For container restores the
policy's container rules say which containers (Kubernetes namespace, image digest) may restore which capsules.

Provenance is recorded in the store when a capsule enters it (store/provenance/<digest>.json: capture or pull, and
from where); a capsule with no record counts as local (only root on this host writes the store)."""

from __future__ import annotations

import fnmatch
import json
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from coldsnap.base.files import atomic_write, private_dir
from coldsnap.base.paths import settings
from coldsnap.capsule import signing
from coldsnap.capsule.store import CapsuleStore, LoadedCapsule
from coldsnap.contracts import ColdSnapError, ErrorCode, RestorePolicy
from coldsnap.contracts import capsule as mt
from coldsnap.contracts.parse import first_error, strict_json

NAMESPACE_ANNOTATIONS = ("io.kubernetes.cri.sandbox-namespace", "io.kubernetes.pod.namespace")


def load_policy() -> RestorePolicy:
    """The restore policy; the defaults when there is no policy file. A policy that does not parse refuses every
    restore (ENVIRONMENT), rather than being read as no policy."""
    path = settings().policy_file
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return RestorePolicy()
    except OSError as e:
        raise ColdSnapError(ErrorCode.ENVIRONMENT, f"restore policy {path}: cannot be read ({e.strerror})") from None
    value = strict_json(raw, f"restore policy {path}", code=ErrorCode.ENVIRONMENT)
    try:
        return RestorePolicy.model_validate(value)
    except ValidationError as e:
        raise ColdSnapError(ErrorCode.ENVIRONMENT, f"restore policy {path}: {first_error(e)}") from None


# --- provenance --------------------------------------------------------------------------------------------------
@dataclass
class Provenance:
    origin: str  # "capture" | "pull" | "local" (no record)
    remote: str | None = None  # HOST/REPO[:TAG] a pull came from


def _provenance_path(store: CapsuleStore, digest: str) -> Path:
    return store.root / "provenance" / f"{digest.replace(':', '-')}.json"


def record(store: CapsuleStore, digest: str, origin: str, remote: str | None = None) -> None:
    """Note how a capsule entered the store; a capture's record is never replaced by a later pull of it."""
    path = _provenance_path(store, digest)
    if origin == "pull" and provenance(store, digest).origin == "capture":
        return
    private_dir(path.parent)
    atomic_write(path, json.dumps({"origin": origin, "remote": remote}).encode(), 0o644)


def provenance(store: CapsuleStore, digest: str) -> Provenance:
    try:
        data = json.loads(_provenance_path(store, digest).read_text())
        return Provenance(origin=str(data["origin"]), remote=data.get("remote"))
    except (OSError, ValueError, KeyError, TypeError):
        return Provenance(origin="local")


def names(store: CapsuleStore, digest: str, prov: Provenance) -> list[str]:
    """What policy patterns match: the local tags of the capsule and, for a pull, HOST/REPO and HOST/REPO:TAG."""
    out = [m["annotations"][mt.ANNOTATION_REF_NAME] for m in store.index()
           if m.get("digest") == digest and mt.ANNOTATION_REF_NAME in (m.get("annotations") or {})]
    if prov.remote:
        out.append(prov.remote)
        repo, sep, tag = prov.remote.rpartition(":")
        if sep and "/" not in tag:
            out.append(repo)
    return out


def adopt_capture(store: CapsuleStore, digest: str) -> str:
    """A capsule this host just captured: signed with its key and recorded as a capture. Returns the key id."""
    key = signing.signing_key()
    assert key is not None  # create=True: made when there is none
    signing.save_signature(store.root, digest, {"bundle": signing.sign(digest, key)})
    record(store, digest, "capture")
    return key.id


def _matches(pattern: str, capsule_names: list[str], digest: str) -> bool:
    return pattern == digest or any(fnmatch.fnmatchcase(n, pattern) for n in capsule_names)


# --- the check ---------------------------------------------------------------------------------------------------
def trusted_keys(policy: RestorePolicy, capsule_names: list[str], digest: str) -> tuple[dict, list[str]]:
    """({key id: public key}, the rules they came from): this host's own key and those of every rule that matches."""
    keys, rules = {}, []
    own = signing.host_public_key()
    if own is not None:
        keys[signing.key_id(own)] = own
        rules.append("this host's own key")
    for i, rule in enumerate(policy.trust):
        if _matches(rule.match, capsule_names, digest):
            rules.append(f"trust[{i}] ({rule.match})")
            for path in rule.keys:
                key = signing.load_public_key(path)
                keys[signing.key_id(key)] = key
    return keys, rules


@dataclass
class TrustVerdict:
    refusal: str | None  # one line naming the rule; None: may restore
    signed_by: str | None = None  # the key id a signature verified against
    provenance: Provenance | None = None


def check(capsule: LoadedCapsule, store: CapsuleStore, container: dict[str, str] | None = None,
          image_digest: str | None = None, policy: RestorePolicy | None = None) -> TrustVerdict:
    """May this capsule be restored here (and into this container, for a container restore: its annotations and
    the image digest it names)?"""
    policy = policy or load_policy()
    prov = provenance(store, capsule.digest)
    capsule_names = names(store, capsule.digest, prov)
    keys, rules = trusted_keys(policy, capsule_names, capsule.digest)
    signed_by = signing.verify_any(signing.saved_signatures(store.root, capsule.digest), capsule.digest, keys)
    label = capsule_names[0] if capsule_names else capsule.digest
    need = policy.pulled if prov.origin == "pull" else policy.local
    if need == "signed" and signed_by is None:
        where = f"pulled from {prov.remote}" if prov.origin == "pull" else "in the local store"
        field = "pulled" if prov.origin == "pull" else "local"
        return TrustVerdict(f"capsule {label} ({where}) is not signed by a trusted key (policy {field}: signed; "
                            f"keys tried: {', '.join(rules) or 'none'})", None, prov)
    refusal = None if container is None else _container_refusal(policy, capsule, capsule_names, container,
                                                                  image_digest)
    return TrustVerdict(refusal, signed_by, prov)


def _container_refusal(policy: RestorePolicy, capsule: LoadedCapsule, capsule_names: list[str],
                       annotations: dict[str, str], image_digest: str | None) -> str | None:
    for i, rule in enumerate(policy.containers):
        if not _matches(rule.match, capsule_names, capsule.digest):
            continue
        where = f"policy containers[{i}] ({rule.match})"
        if rule.namespaces is not None:
            ns = next((annotations[k] for k in NAMESPACE_ANNOTATIONS if annotations.get(k)), None)
            if ns not in rule.namespaces:
                return (f"{where} lets namespaces {', '.join(rule.namespaces) or 'none'} restore this capsule; this "
                        f"container is in {ns or 'no Kubernetes namespace'}")
        if rule.image_digest == "must-match":
            captured = capsule.profile.image_digest
            if not captured:
                return f"{where} needs the captured image's digest, and the capsule records none"
            if image_digest != captured:
                return (f"{where}: the container's image {image_digest or '(not named: io.coldsnap.image-digest)'} "
                        f"is not the captured image {captured}")
        return None
    return None
