"""Receipts: build, hash and write one per operation (0600, <receipts>/<operation id>.json), whatever the outcome.
Every flow returns its receipt (contracts.Receipt); a ColdSnapError that ends an operation carries it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from coldsnap import __version__
from coldsnap.base.files import atomic_write, private_dir
from coldsnap.base.paths import settings
from coldsnap.contracts import ColdSnapError, ErrorCode, ErrorInfo, Receipt, sha256_hex
from coldsnap.contracts.receipt import State
from coldsnap.contracts.results import Operation, Result
from coldsnap.flows.resources import out_of_room
from coldsnap.flows.spans import Timeline


def receipt_path(operation_id: str) -> Path:
    return settings().receipts / f"{operation_id}.json"


def failed_state(error: ColdSnapError) -> State:
    """A refusal (the capsule does not fit here) reads differently from a failure."""
    return "refused" if error.code == ErrorCode.INCOMPATIBLE else "failed"


def finish_receipt(request, op_id: str, operation: Operation, tl: Timeline, state: State,
                   result: Result | None = None, error: ColdSnapError | None = None) -> Receipt:
    """Build and write the receipt; an error that ends the operation carries it to the entry point."""
    receipt = Receipt(
        operation=operation, operation_id=op_id, request_sha256=sha256_hex(request.model_dump(mode="json")),
        state=state, origin=tl.origin, spans=tl.spans, result=result, coldsnap_version=__version__,
        error=ErrorInfo(code=error.code, message=error.message, exit_code=error.exit_code) if error else None)
    path = receipt_path(op_id)
    private_dir(path.parent)
    atomic_write(path, receipt.model_dump_json(indent=1).encode())
    if error is not None:
        error.receipt = receipt
    return receipt


@contextmanager
def receipt_on_failure(request, op_id: str, operation: Operation, tl: Timeline) -> Iterator[None]:
    """A ColdSnapError leaving the block gets a receipt (refused or failed) unless it already has one; so does a
    full disk, a quota or the open-files limit, which leave as environment errors (exit 12)."""
    try:
        yield
    except ColdSnapError as e:
        if e.receipt is None:
            finish_receipt(request, op_id, operation, tl, failed_state(e), error=e)
        raise
    except OSError as e:
        written = getattr(e, "filename2", None) or getattr(e, "filename", None)
        err = out_of_room(e, Path(written).parent if written else settings().run)
        if not isinstance(err, ColdSnapError):
            raise
        finish_receipt(request, op_id, operation, tl, "failed", error=err)
        raise err from None
