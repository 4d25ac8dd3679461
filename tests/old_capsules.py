"""Capsules in the format ColdSnap wrote before 2026-12-05, for the tests that hold it to reading them: the weights
as a payload artifact of their own (an empty config, one layer per weight file), named by the capsule's
`io.coldsnap.payload` annotation instead of being layers of the capsule."""

import json

from coldsnap.capsule.payload import put_weights
from coldsnap.capsule.store import CapsuleStore
from coldsnap.contracts import WeightFile
from coldsnap.contracts import capsule as mt


def write_payload(store: CapsuleStore, weights: list[WeightFile]) -> str:
    """The weights' blobs and a payload manifest naming them; returns its digest (not indexed: a capsule names it)."""
    layers = put_weights(store, weights)
    config = store.put_bytes(b"{}", "application/vnd.oci.empty.v1+json")
    manifest = {"schemaVersion": 2, "mediaType": mt.MANIFEST_MEDIA_TYPE, "artifactType": mt.PAYLOAD_ARTIFACT_TYPE,
                "config": config.to_json(), "layers": [d.to_json() for d in layers]}
    return store.put_bytes(json.dumps(manifest, indent=1, sort_keys=True).encode(), mt.MANIFEST_MEDIA_TYPE).digest
