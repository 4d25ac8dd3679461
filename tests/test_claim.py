"""A workload name is claimed in one step: a live claim refuses a second operation of that name (exit 6's code,
one line), a claim whose owner was SIGKILLed holds nothing, and recovery removes it without a word. (The real
races, two restores or two captures of one name at once, are in test_shared_hosts.py.)"""

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from coldsnap.base import journal as journals
from coldsnap.contracts import ColdSnapError, ErrorCode
from coldsnap.flows.recovery import recover
from coldsnap.workload.claim import claimant, claimed

HOLDER = textwrap.dedent("""
    import sys, time
    from coldsnap.workload.claim import claimed
    with claimed("web", "restore"):
        print("claimed", flush=True)
        time.sleep(120)
""")


@pytest.fixture
def holder(coldsnap_home):
    proc = subprocess.Popen([sys.executable, "-c", HOLDER], stdout=subprocess.PIPE, text=True, env=os.environ)
    assert proc.stdout.readline().strip() == "claimed"
    yield proc
    proc.kill()
    proc.wait()


def test_a_live_claim_refuses_the_same_name_and_not_another(holder):
    with pytest.raises(ColdSnapError) as refused:
        with claimed("web", "capture"):
            pass
    assert refused.value.code == ErrorCode.RESOURCE_BUSY
    assert f"pid {holder.pid}" in refused.value.message and "\n" not in refused.value.message
    with claimed("api", "capture"):  # another name is free
        assert claimant("api") is not None
    assert claimant("api") is None  # released at the end of the block


def test_a_claim_whose_owner_was_killed_holds_nothing_and_recovery_removes_it(holder):
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert [j.kind for j in journals.entries()] == ["claim"]  # left behind, owner gone
    with claimed("web", "restore"):
        assert claimant("web").owner["pid"] == os.getpid()
    assert recover() == []  # nothing to say about a claim
    assert journals.entries() == []


def test_a_claim_is_released_when_the_block_fails(coldsnap_home):
    with pytest.raises(RuntimeError):
        with claimed("web", "restore"):
            raise RuntimeError("restore failed")
    assert claimant("web") is None and journals.entries() == []
