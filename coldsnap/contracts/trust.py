"""The restore policy: who may restore which capsule (`/etc/coldsnap/policy.json`, or COLDSNAP_POLICY_FILE;
`coldsnap schema policy`). Evaluated at admission, before anything is staged (coldsnap.capsule.trust)."""

from __future__ import annotations

from typing import Final, Literal

from pydantic import Field

from coldsnap.contracts.base import Strict

POLICY_FORMAT: Final = 1


class TrustRule(Strict):
    """Keys that vouch for capsules with a matching name."""

    match: str = Field(description="fnmatch pattern over a capsule's names: the registry repository it was pulled "
                       "from (HOST/REPO, and HOST/REPO:TAG) and its local tags")
    keys: list[str] = Field(min_length=1, description="PEM public keys (ECDSA P-256, as cosign writes cosign.pub)")


class ContainerRule(Strict):
    """Which containers may restore capsules with a matching name."""

    match: str = Field(description="fnmatch pattern over a capsule's names (as in TrustRule.match)")
    namespaces: list[str] | None = Field(default=None, description="Kubernetes namespaces whose pods may restore "
                                         "them (the container's io.kubernetes.cri.sandbox-namespace or "
                                         "io.kubernetes.pod.namespace annotation); null: any container")
    image_digest: Literal["must-match", "any"] = Field(
        default="must-match", description="must-match: the container must name its image digest "
        "(io.coldsnap.image-digest) and it must be the one the capsule was captured from")


class RestorePolicy(Strict):
    format: Literal[1] = POLICY_FORMAT
    trust: list[TrustRule] = Field(default_factory=list, description="keys trusted per capsule name; this host's "
                                   "own capsule key (COLDSNAP_HOME/keys/capsule.pub) is always trusted")
    pulled: Literal["signed", "any"] = Field(default="signed", description="a capsule pulled from a registry must "
                                             "be signed by a trusted key (signed), or may restore unsigned (any)")
    local: Literal["any", "signed"] = Field(default="any", description="a capsule captured on this host (or found "
                                            "in its store with no record of a pull): restores as it is (any; "
                                            "captures are signed with this host's key), or must verify (signed)")
    containers: list[ContainerRule] = Field(default_factory=list, description="rules for container restores "
                                            "(coldsnap-runtime); the first rule that matches a capsule decides, and "
                                            "a capsule no rule matches may be restored by any container")
