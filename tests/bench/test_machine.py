from bench import describe_cpu


def test_machines_lscpu_names_alike_are_told_apart_by_family_and_vector_isa():
    zen5 = {"Model name": " AMD EPYC", "CPU family": " 26", "Model": " 2", "CPU(s)": " 2",
            "Flags": " fpu sse avx2 avx512f avx512bw"}
    zen3 = dict(zen5, **{"CPU family": "25", "Model": "1", "Flags": "fpu sse avx2"})
    assert describe_cpu(zen5) == "AMD EPYC (family 26 model 2, AVX-512), 2 CPUs"
    assert describe_cpu(zen3) == "AMD EPYC (family 25 model 1, AVX2), 2 CPUs"
    assert describe_cpu({"Model name": "Some CPU", "CPU(s)": "4"}) == "Some CPU, 4 CPUs"
