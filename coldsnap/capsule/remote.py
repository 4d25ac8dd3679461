"""One repository on one registry, spoken to over the OCI distribution API: references (HOST[:PORT]/REPO:TAG or
@sha256:…), the HTTP client with oras-py's token auth (bearer tokens; credentials from ~/.docker/config.json or
COLDSNAP_REGISTRY_USER / COLDSNAP_REGISTRY_PASSWORD, sent as Basic where the registry challenges so), and the
registry's errors said in one line. Push and pull (coldsnap.capsule.registry) speak through it."""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from http.cookiejar import DefaultCookiePolicy

import oras.auth
import oras.container
import requests

from coldsnap.base.paths import settings
from coldsnap.capsule.store import DIGEST_RE
from coldsnap.contracts import ColdSnapError, ErrorCode
from coldsnap.contracts import capsule as mt

MANIFEST_LIMIT = 4 << 20
CONNECT_TIMEOUT = 10
READ_TIMEOUT = 300
_REPO_RE = re.compile(r"^[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*$")
_TAG_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
_LOGIN = "log in (~/.docker/config.json) or set COLDSNAP_REGISTRY_USER and COLDSNAP_REGISTRY_PASSWORD"
_ACCEPT = {"Accept": f"{mt.MANIFEST_MEDIA_TYPE}, {mt.INDEX_MEDIA_TYPE}"}


def registry_error(msg: str) -> ColdSnapError:
    return ColdSnapError(ErrorCode.REGISTRY, msg)


# --- references -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RemoteRef:
    host: str
    repository: str
    tag: str | None
    digest: str | None

    @property
    def name(self) -> str:
        return f"{self.host}/{self.repository}"

    @property
    def tagged(self) -> str:
        return self.name + (f":{self.tag}" if self.tag else "")

    def __str__(self) -> str:
        return self.tagged + (f"@{self.digest}" if self.digest else "")


def parse_remote(ref: str) -> RemoteRef:
    """HOST[:PORT]/REPO:TAG, HOST[:PORT]/REPO@sha256:…, or HOST[:PORT]/REPO:TAG@sha256:…"""
    bad = f"registry reference {ref!r} must look like HOST[:PORT]/REPO:TAG or HOST[:PORT]/REPO@sha256:<64 hex>"
    rest, at, pinned = ref.partition("@")
    digest = pinned if at else None
    if (digest is not None and not DIGEST_RE.match(digest)) or "/" not in rest:
        raise ColdSnapError(ErrorCode.INVALID_REQUEST, bad)
    host, path = rest.split("/", 1)
    tag = None
    if ":" in path.rsplit("/", 1)[-1]:
        path, tag = path.rsplit(":", 1)
    if not host or not _REPO_RE.match(path) or (tag is not None and not _TAG_RE.match(tag)):
        raise ColdSnapError(ErrorCode.INVALID_REQUEST, bad)
    return RemoteRef(host, path, tag, digest)


# --- HTTP -----------------------------------------------------------------------------------------------------
class _Session(requests.Session):
    def request(self, method, url, **kw):  # requests has no session-wide timeout
        kw.setdefault("timeout", (CONNECT_TIMEOUT, READ_TIMEOUT))
        return super().request(method, url, **kw)


class Client:
    """One repository on one registry, spoken to with oras' token auth (credentials, bearer tokens) and our own
    requests and error handling (oras' Registry would retry "connection refused" for 83 s, and loads a JSON schema
    validator a restore's start waits for)."""

    def __init__(self, ref: RemoteRef, insecure: bool):
        self.ref = ref
        self.scheme = "http" if insecure else "https"
        self.session = _Session()
        self.session.cookies.set_policy(DefaultCookiePolicy(allowed_domains=[]))  # some registries set CSRF ones
        self.auth = oras.auth.get_auth_backend("token", self.session, insecure)
        self.static: dict[str, str] = {}
        user, password = settings().registry_user, settings().registry_password
        if user and password:
            self.auth.set_basic_auth(user, password)
        else:  # ~/.docker/config.json (auths, credsStore, credHelpers); unreadable means "no credentials"
            with contextlib.suppress(Exception):
                self.auth.load_configs(oras.container.Container(f"{ref.name}:x", registry=ref.host))
        self.base = f"{self.scheme}://{ref.host}/v2/{ref.repository}"
        self._ping()

    def _creds(self) -> str | None:
        return getattr(self.auth, "_basic_auth", None) or None

    def _ping(self) -> None:
        url = f"{self.scheme}://{self.ref.host}/v2/"
        r = self._send("GET", url, auth=False)
        if r.status_code == 401:
            challenge = r.headers.get("Www-Authenticate", "")
            if challenge.lower().startswith("basic"):
                if not self._creds():
                    raise self._denied(r)
                self.static["Authorization"] = f"Basic {self._creds()}"
                r = self._send("GET", url, auth=False)
                if r.status_code in (401, 403):
                    raise self._denied(r)
            return  # Bearer: oras' TokenAuth answers the challenge per request
        if r.status_code != 200:
            raise registry_error(f"{self.ref.host} does not speak the OCI distribution API (GET /v2/ answered "
                                  f"{r.status_code})")

    def _denied(self, r: requests.Response) -> ColdSnapError:
        how = "the credentials were refused" if self._creds() else f"it needs credentials: {_LOGIN}"
        return registry_error(f"registry {self.ref.host} denied access to {self.ref.repository} ({r.status_code}): "
                               f"{how}")

    def _send(self, method: str, url: str, *, headers: dict | None = None, data=None, stream: bool = False,
              auth: bool = True) -> requests.Response:
        h = {**self.static, **(headers or {})}
        try:
            if not auth:
                return self.session.request(method, url, headers=h, data=data, stream=stream)
            r = self._answering_challenges(method, url, h, data, stream)
            if r.status_code == 401 and getattr(self.auth, "token", None):
                # a token kept from an earlier request may be scoped too narrowly (pull → push): drop it and
                # answer the new challenge once
                self.auth.token = None
                r = self._answering_challenges(method, url, h, data, stream)
            return r
        except requests.exceptions.SSLError as e:
            raise registry_error(f"TLS with registry {self.ref.host} failed ({short_error(e)}); for a plain-HTTP local "
                                  "registry use insecure") from None
        except requests.exceptions.ConnectionError as e:
            raise registry_error(f"cannot connect to registry {self.ref.host} over {self.scheme}: "
                                  f"{short_error(e)}") from None
        except requests.exceptions.Timeout:
            raise registry_error(f"registry {self.ref.host} did not answer in time") from None
        except ValueError as e:  # oras: "Cannot respond to request for authentication."
            if "authentication" in str(e):
                raise registry_error(f"registry {self.ref.host} asked for authentication that could not be "
                                      f"answered: {_LOGIN}") from None
            raise

    def _answering_challenges(self, method: str, url: str, headers: dict, data, stream: bool) -> requests.Response:
        """The request with the token kept from the last challenge, if any; a 401 or 403 is answered (Basic
        credentials, or a bearer token for the scope asked) and the request sent again; a 403 after that once
        more with a fresh token. ValueError where a challenge cannot be answered."""
        if isinstance(self.auth, oras.auth.TokenAuth) and self.auth.token is not None:
            headers = {**headers, **self.auth.get_auth_header()}
        r = self.session.request(method, url, headers=headers, data=data, stream=stream)
        for refresh, answered in ((False, (401, 403)), (True, (403,))):
            if r.status_code not in answered:
                break
            headers, changed = self.auth.authenticate_request(r, headers, refresh=refresh)
            if not changed:
                raise ValueError("Cannot respond to request for authentication.")
            r.close()
            r = self.session.request(method, url, headers=headers, data=data, stream=stream)
        return r

    def request(self, method: str, url: str, *, ok: tuple[int, ...], what: str, headers: dict | None = None,
                data=None, stream: bool = False, not_found: ErrorCode | None = None) -> requests.Response:
        r = self._send(method, url, headers=headers, data=data, stream=stream)
        if r.status_code in ok:
            return r
        said = registry_said(r)  # what the registry said, before the body goes
        r.close()
        if r.status_code in (401, 403):
            raise self._denied(r)
        if r.status_code == 404 and not_found:
            raise ColdSnapError(not_found, f"{what}: not found in registry {self.ref.host}"
                                + (f" (it said {said})" if said else ""))
        raise self.refused(r, what, said)

    def refused(self, r: requests.Response, what: str, said: str) -> ColdSnapError:
        return registry_error(f"{what}: registry {self.ref.host} answered {r.status_code} {said}".rstrip())

    def manifest(self, ref: str, what: str) -> tuple[bytes, requests.Response]:
        """A manifest (or index) by tag or digest, read up to one byte past MANIFEST_LIMIT."""
        r = self.request("GET", f"{self.base}/manifests/{ref}", ok=(200,), what=what, headers=_ACCEPT,
                         not_found=ErrorCode.CAPSULE_NOT_FOUND, stream=True)
        with r:
            return r.raw.read(MANIFEST_LIMIT + 1, decode_content=True), r

    def location(self, r: requests.Response) -> str:
        loc = r.headers.get("Location")
        if not loc:
            raise registry_error(f"registry {self.ref.host} gave no upload location")
        return loc if loc.startswith("http") else f"{self.scheme}://{self.ref.host}{loc}"


def short_error(e: Exception) -> str:
    s = str(e)
    for known in ("Connection refused", "Name or service not known", "Connection reset", "No route to host",
                  "timed out", "Temporary failure in name resolution", "WRONG_VERSION_NUMBER",
                  "CERTIFICATE_VERIFY_FAILED"):
        if known in s:
            return known.lower().replace("_", " ")
    return s[:200]


def registry_said(r: requests.Response) -> str:
    try:
        errs = r.json().get("errors", [])
        return "(" + "; ".join(f"{e.get('code')}: {e.get('message')}" for e in errs) + ")" if errs else ""
    except ValueError:
        return ""
