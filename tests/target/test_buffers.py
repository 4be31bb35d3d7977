"""HBM bytes from XLA:TPU's memory-usage report: every memory space but the on-chip ones."""

from __future__ import annotations

from jaxpod.target.buffers import device_memory_bytes, memory_spaces

# The head of each memory space's section, as XLA:TPU writes them (v5p, then v4).
V5P = """Memory Space: default (color=0)
Total bytes: 8569888 (8.17MiB)
  cumulative_size;       size;       offset; used_by_n_values; shapes_list
Memory Space: vmem (color=1)
Total bytes: 3494912 (3.33MiB)
Memory Space: smem (color=2)
Total bytes: 116 (116B)
Memory Space: color_6 (color=6)
Total bytes: 4096 (4.0KiB)
"""
V5P_OFFLOADED = """Memory Space: default (color=0)
Total bytes: 172584480 (164.59MiB)
Memory Space: vmem (color=1)
Total bytes: 50092032 (47.77MiB)
Memory Space: smem (color=2)
Total bytes: 128 (128B)
Memory Space: cmem (color=5)
Total bytes: 102481920 (97.73MiB)
Memory Space: color_6 (color=6)
Total bytes: 4096 (4.0KiB)
"""
V4 = """Memory Space: default (color=0)
Total bytes: 43000000 (41.0MiB)
Memory Space: smem (color=2)
Total bytes: 200 (200B)
Memory Space: hbm (color=3)
Total bytes: 69900000 (66.7MiB)
"""


def test_each_space_is_read():
    assert memory_spaces(V5P) == {
        "default": 8569888,
        "vmem": 3494912,
        "smem": 116,
        "color_6": 4096,
    }


def test_hbm_is_every_space_but_vmem_smem_and_the_host():
    assert device_memory_bytes(memory_spaces(V5P)) == 8569888 + 4096
    assert device_memory_bytes(memory_spaces(V5P_OFFLOADED)) == 172584480 + 4096
    assert device_memory_bytes(memory_spaces(V4)) == 43000000 + 69900000
    assert device_memory_bytes({}) == 0
