"""Capsule media types and annotation keys (OCI conventions, reverse-DNS keys)."""

ARTIFACT_TYPE = "application/vnd.coldsnap.capsule.v1+json"
CONFIG_MEDIA_TYPE = "application/vnd.coldsnap.capsule.profile.v1+json"
LAYER_CRIU = "application/vnd.coldsnap.criu.images.v1.tar+zstd"
LAYER_FILES = "application/vnd.coldsnap.files.v1.tar+zstd"
LAYER_WEIGHTS_MANIFEST = "application/vnd.coldsnap.weights.manifest.v1+json"
MANIFEST_MEDIA_TYPE = "application/vnd.oci.image.manifest.v1+json"
INDEX_MEDIA_TYPE = "application/vnd.oci.image.index.v1+json"

ANNOTATION_CAPSULE = "io.coldsnap.capsule"
ANNOTATION_POLICY = "io.coldsnap.policy"
ANNOTATION_VALIDATION = "io.coldsnap.validation"
ANNOTATION_ENGINE = "io.coldsnap.engine"
ANNOTATION_MODEL = "io.coldsnap.model"
ANNOTATION_REF_NAME = "org.opencontainers.image.ref.name"
ANNOTATION_CREATED = "org.opencontainers.image.created"
ANNOTATION_TITLE = "org.opencontainers.image.title"

PAYLOAD_ARTIFACT_TYPE = "application/vnd.coldsnap.payload.v1+json"
# What a tag names in a registry when a capsule has a weights payload: an index of the two, so that copy tools
# (`oras cp -r`, `skopeo copy --all`) and registries that prune untagged manifests keep the payload with its capsule.
INDEX_ARTIFACT_TYPE = "application/vnd.coldsnap.capsule.index.v1+json"
LAYER_WEIGHTS = "application/vnd.coldsnap.weights.safetensors.v1"
ANNOTATION_PAYLOAD = "io.coldsnap.payload"
ANNOTATION_PATH = "io.coldsnap.path"
# On a full capsule: the digest of the template capsule of the same engine and model, captured with it
# (--snapshot-driver both), for a restore that admission refuses the full capsule for.
ANNOTATION_TEMPLATE = "io.coldsnap.template"
ANNOTATION_MODE = "io.coldsnap.mode"
ANNOTATION_IMAGE_DIGEST = "io.coldsnap.image-digest"
ANNOTATION_ENV_NAMES = "io.coldsnap.env-names"  # manifest: the environment variable names (never values) captured

# What a container may ask of coldsnap-runtime (its annotations, or COLDSNAP_* env for docker); any other
# io.coldsnap.* key is a typo that would silently change behaviour (a policy meant to refuse), so it is refused.
CONTAINER_ANNOTATIONS = (ANNOTATION_CAPSULE, ANNOTATION_POLICY, ANNOTATION_VALIDATION, ANNOTATION_IMAGE_DIGEST)
MAX_ANNOTATION_BYTES = 64 << 10
