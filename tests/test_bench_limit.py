"""The physical limit beside each benchmark figure: bytes / bandwidths measured in the same run."""

from coldsnap.bench.bandwidth import restore_limit

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
