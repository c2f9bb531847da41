import pytest

from agentrl.host import machine_line


@pytest.mark.parametrize("flags, vector", [("fpu avx2 avx512f avx512_bf16 amx_tile", "AVX-512 BF16, AMX"),
                                           ("fpu avx2 avx512f", "AVX-512"), ("fpu sse4_2 avx2", "AVX2"),
                                           ("fpu sse4_2", "no AVX2")])
def test_the_machine_line_names_the_cpu_and_its_widest_vector_extension(tmp_path, flags, vector):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nmodel name\t: Some CPU 9000\nflags\t\t: {flags}\n\n"
                       f"processor\t: 1\nmodel name\t: Some CPU 9000\nflags\t\t: {flags}\n")
    line = machine_line(str(cpuinfo))
    assert line.startswith("machine: Some CPU 9000, ") and line.endswith(f"usable cores, {vector}")
    assert machine_line(str(tmp_path / "absent")).startswith("machine: unknown CPU, ")
