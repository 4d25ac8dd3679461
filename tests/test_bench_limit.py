"""The physical limit beside each benchmark figure: bytes / bandwidths measured in the same run."""

from coldsnap_bench.bandwidth import restore_limit

BW = {"host_memcpy_parallel_gbs": 40.0, "page_cache_read_parallel_gbs": 20.0, "pinned_h2d_gbs": 50.0}


def test_weights_apart_cross_from_page_cache_to_the_gpu():
    # recovery (pinned file) or native saved as a payload: images through host memory, weights file -> GPU at the
    # slowest of page-cache read, host copy and H2D
    lim = restore_limit(BW, images_bytes=4 * 10**9, weights_bytes=10 * 10**9, weights_in_images=False)
    assert lim["host_s"] == 0.1 and lim["gpu_s"] == 0.5 and lim["limit_s"] == 0.6


def test_weights_in_the_images_count_every_image_byte_as_gpu_bytes():
    lim = restore_limit(BW, images_bytes=4 * 10**9, weights_bytes=10 * 10**9, weights_in_images=True)
    assert lim["gpu_bytes_upper"] == 4 * 10**9 and lim["gpu_s"] == 0.2 and lim["limit_s"] == 0.3


def test_no_measured_bandwidth_gives_no_limit():
    assert restore_limit({}, 1, 1, weights_in_images=False) == {}


def test_cold_cache_benches_count_every_byte_at_the_disk_rate():
    bw = {**BW, "disk_read_parallel_gbs": 2.0}
    lim = restore_limit(bw, images_bytes=4 * 10**9, weights_bytes=10 * 10**9, weights_in_images=False, from_disk=True)
    assert lim["host_s"] == 2.0 and lim["gpu_s"] == 5.0 and lim["limit_s"] == 7.0 and lim["source"].startswith("disk")
    # no disk rate measured: no limit rather than a page-cache one beside a cold figure
    assert restore_limit(BW, 1, 1, weights_in_images=False, from_disk=True) == {}


def test_the_disk_rate_is_measured_with_the_page_cache_dropped(tmp_path):
    """The real probe: a file read back from disk after the drop (root; the rate must be a positive number)."""
    import os

    import pytest

    from coldsnap_bench.bandwidth import measure

    if os.geteuid() != 0:
        pytest.skip("dropping the page cache needs root")
    f = tmp_path / "blob"
    f.write_bytes(os.urandom(1 << 20) * 64)
    bw = measure(f, f)
    assert bw.get("disk_read_parallel_gbs", 0) > 0 and bw["disk_read_bytes"] == 64 << 20, bw
