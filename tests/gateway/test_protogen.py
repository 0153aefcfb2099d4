from gateway import protogen


def test_generated_code_matches_the_proto(tmp_path):
    protogen.generate(tmp_path)
    for name in protogen.FILES:
        assert (tmp_path / name).read_text() == (protogen.OUT / name).read_text(), \
            f"gateway/pb/{name} is stale: run python -m gateway.protogen"
