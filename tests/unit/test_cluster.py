import json

import pytest

from pdtool.artifacts.cluster import DEFAULT_SERVERS, PRESETS, SCHEMA, Cluster, Level, parse_cluster, preset
from pdtool.errors import ArtifactError, PdtoolError, PlanError
from pdtool.jsonio import canonical_json
from pdtool.units import (exact_bandwidth, exact_bytes, exact_duration, format_bandwidth, format_bytes,
                          format_duration, parse_bandwidth, parse_duration,
                          parse_bytes)

GiB = 2**30


# ----- units: bandwidth ----------------------------------------------------------------------------
@pytest.mark.parametrize("text, expected", [
    ("12GB/s", 12e9),
    ("12 GB/s", 12e9),
    (" 12 GB / s ", 12e9),
    ("1.5GiB/s", 1.5 * 2**30),
    ("1GiB/s", 2**30),
    ("10Gbit/s", 1.25e9),
    ("10Gb/s", 1.25e9),
    ("10 Gbps", 1.25e9),
    ("100Mbit/s", 12.5e6),
    ("500MB/s", 500e6),
    ("1.25e9B/s", 1.25e9),
    ("1e3kB/s", 1e6),
    ("3KB/s", 3e3),
    ("2KiB/s", 2048),
    ("1MiB/s", 2**20),
    ("1TB/s", 1e12),
    ("1TiB/s", 2**40),
    ("8bit/s", 1.0),
    ("1Gibit/s", 2**30 / 8),
    (".5GB/s", 0.5e9),
])
def test_parse_bandwidth_exact_values(text, expected):
    assert parse_bandwidth(text) == expected


def test_bytes_and_bits_are_never_confused():
    assert parse_bandwidth("10Gbit/s") == parse_bandwidth("10Gb/s") == 1.25e9
    assert parse_bandwidth("10GB/s") == 10e9
    assert parse_bandwidth("10GB/s") == 8 * parse_bandwidth("10Gb/s")
    assert parse_bandwidth("12GB/s") == 12e9
    assert parse_bandwidth("1GiB/s") == 2**30


@pytest.mark.parametrize("text", ["", "12", "12GB", "12 G/s", "GB/s", "12gB/s", "12 GB/h", "12mB/s",
                                  "twelve GB/s", "12GB/s/s", "-1GB/s", "0GB/s", "1e999GB/s", "12 XB/s"])
def test_parse_bandwidth_rejects_with_one_line_naming_text_and_forms(text):
    with pytest.raises(PlanError) as info:
        parse_bandwidth(text)
    message = str(info.value)
    assert "\n" not in message
    assert repr(text) in message
    assert "10Gbit/s" in message and "12GB/s" in message


# ----- units: bytes ----------------------------------------------------------------------------------
@pytest.mark.parametrize("text, expected", [
    ("16GiB", 16 * GiB),
    ("16 GiB", 16 * GiB),
    ("16GB", 16_000_000_000),
    ("512MiB", 512 * 2**20),
    ("1e9B", 1_000_000_000),
    ("1.5GiB", 3 * 2**29),
    ("100 bytes", 100),
    ("4kB", 4000),
    ("4KiB", 4096),
])
def test_parse_bytes_exact_values(text, expected):
    value = parse_bytes(text)
    assert value == expected and isinstance(value, int)


@pytest.mark.parametrize("text", ["", "16", "16G", "16Gb", "16Gbit", "16 bits", "0GB", "0.1B", "GiB", "16 GiB/s"])
def test_parse_bytes_rejects_with_one_line(text):
    with pytest.raises(PlanError) as info:
        parse_bytes(text)
    message = str(info.value)
    assert "\n" not in message and repr(text) in message and "16GiB" in message


def test_memory_in_bits_says_bytes_are_needed():
    with pytest.raises(PlanError, match=r"in bits; give memory in bytes"):
        parse_bytes("16Gbit")


# ----- units: formatting -----------------------------------------------------------------------------
@pytest.mark.parametrize("value, unit, expected", [
    (1.25e9, "B", "1.25 GB/s"),
    (12e9, "B", "12 GB/s"),
    (2**30, "B", "1 GiB/s"),
    (1234567891.0, "B", "1.235 GB/s"),
    (1.25e9, "bit", "10 Gbit/s"),
    (1.25e9, "auto", "10 Gbit/s"),
    (3.125e9, "auto", "25 Gbit/s"),
    (12e9, "auto", "12 GB/s"),
    (25e9, "auto", "25 GB/s"),
    (500e6, "auto", "500 MB/s"),
    (1.5 * 2**30, "auto", "1.5 GiB/s"),
    (12.5e6, "auto", "100 Mbit/s"),
])
def test_format_bandwidth(value, unit, expected):
    assert format_bandwidth(value, unit) == expected


@pytest.mark.parametrize("value, expected", [
    (16 * GiB, "16 GiB"), (16_000_000_000, "16 GB"), (512 * 2**20, "512 MiB"), (1000, "1 kB"),
    (1024, "1 KiB"), (3, "3 B"), (123_456_789, "123.5 MB"),
])
def test_format_bytes(value, expected):
    assert format_bytes(value) == expected


@pytest.mark.parametrize("value", [12e9, 1.25e9, 3.125e9, 2**30, 1.5 * 2**30, 1234567891.123, 0.1, 7e15])
def test_exact_bandwidth_parses_back_exactly(value):
    assert parse_bandwidth(exact_bandwidth(value)) == value


@pytest.mark.parametrize("value", [16 * GiB, 16_000_000_000, 123_456_789, 1, 17_179_869_183])
def test_exact_bytes_parses_back_exactly(value):
    assert parse_bytes(exact_bytes(value)) == value


# ----- cluster: the levels form ---------------------------------------------------------------------
def test_two_levels_innermost_first():
    cluster = parse_cluster("4x12GB/s,4x10Gbit/s")
    assert cluster == Cluster(levels=(Level(4, 12e9), Level(4, 1.25e9)))
    assert cluster.workers == 16 and cluster.memory is None and cluster.name is None


@pytest.mark.parametrize("spec", ["4x12GB/s, 4x10Gbit/s", " 4 x 12 GB/s , 4 X 10 Gbit/s ",
                                  "4x V100 @ 12 GB/s, 4x servers @ 10 Gbit/s"])
def test_levels_tolerate_spaces_and_labels(spec):
    assert parse_cluster(spec) == Cluster(levels=(Level(4, 12e9), Level(4, 1.25e9)))


def test_single_level_and_memory():
    cluster = parse_cluster("8x10Gbit/s", memory="16GiB")
    assert cluster.levels == (Level(8, 1.25e9),) and cluster.workers == 8 and cluster.memory == 16 * GiB


def test_three_levels_multiply():
    assert parse_cluster("2x50GB/s,4x12GB/s,3x10Gbit/s").workers == 24


@pytest.mark.parametrize("spec, fragment", [
    ("", "empty cluster spec"),
    ("   ", "empty cluster spec"),
    ("0x12GB/s", "has count 0"),
    ("-2x12GB/s", "has count -2"),
    ("4x12GB/s,0x10Gbit/s", "level 2 of 2 '0x10Gbit/s' has count 0"),
    ("4x12GB", "bandwidth '12GB' is not understood"),
    ("4x12 furlongs/s", "is not understood"),
    ("4x12GB/s,", "level 2 of 2 in '4x12GB/s,' is empty"),
    ("4x", "'4x' is malformed"),
    ("12GB/s", "gives a bandwidth but no count"),
    ("cluster-z", "unknown cluster preset 'cluster-z'"),
    ("cluster-a:0", "server count '0'"),
    ("cluster-a:two", "server count 'two'"),
    ("#!?", "is not understood"),
])
def test_spec_errors_are_one_line_naming_the_spec(spec, fragment):
    with pytest.raises(PdtoolError) as info:
        parse_cluster(spec)
    message = str(info.value)
    assert "\n" not in message and fragment in message


def test_unknown_preset_lists_presets_and_forms():
    with pytest.raises(PlanError) as info:
        parse_cluster("dgx")
    message = str(info.value)
    for name in PRESETS:
        assert name in message
    assert "4x12GB/s,4x10Gbit/s" in message and "JSON" in message


def test_bad_memory_override():
    with pytest.raises(PlanError, match="memory size '16' is not understood"):
        parse_cluster("4x12GB/s", memory="16")


def test_levels_and_cluster_validate_themselves():
    with pytest.raises(PlanError):
        Level(0, 1e9)
    with pytest.raises(PlanError):
        Level(2, 0.0)
    with pytest.raises(PlanError):
        Cluster(levels=())
    with pytest.raises(PlanError):
        Cluster(levels=(Level(2, 1e9),), memory=0)


# ----- cluster: presets ------------------------------------------------------------------------------
def test_preset_cluster_a_default_servers():
    cluster = parse_cluster("cluster-a")
    assert cluster.levels == (Level(4, 12e9), Level(DEFAULT_SERVERS, 1.25e9))
    assert cluster.workers == 16 and cluster.memory == 16 * GiB and cluster.name == "cluster-a:4"


def test_preset_cluster_b_with_servers():
    cluster = parse_cluster("cluster-b:2")
    assert cluster.levels == (Level(8, 25e9), Level(2, 3.125e9))
    assert cluster.workers == 16 and cluster.memory == 16 * GiB and cluster.name == "cluster-b:2"


def test_preset_name_is_case_insensitive_and_memory_overrides():
    cluster = parse_cluster("Cluster-A:1", memory="32GB")
    assert cluster.name == "cluster-a:1" and cluster.workers == 4 and cluster.memory == 32_000_000_000
    assert preset("cluster-a", 1) == parse_cluster("cluster-a:1")


def test_preset_name_parses_back():
    for name in PRESETS:
        cluster = parse_cluster(f"{name}:3")
        assert parse_cluster(cluster.name) == cluster


# ----- cluster: JSON ---------------------------------------------------------------------------------
def test_json_file_form(tmp_path):
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps({"levels": [{"count": 4, "bandwidth": "12GB/s"},
                                           {"count": 4, "bandwidth": 1.25e9}], "memory": "16GiB"}))
    cluster = parse_cluster(str(path))
    assert cluster == Cluster(levels=(Level(4, 12e9), Level(4, 1.25e9)), memory=16 * GiB)
    assert parse_cluster(str(path), memory="8GiB").memory == 8 * GiB


def test_json_numbers_are_bytes(tmp_path):
    path = tmp_path / "c.json"
    path.write_text('{"levels": [{"count": 2, "bandwidth": 1000}], "memory": 16000000000}')
    assert parse_cluster(str(path)) == Cluster(levels=(Level(2, 1000.0),), memory=16_000_000_000)


def test_json_missing_and_malformed_files(tmp_path):
    with pytest.raises(ArtifactError, match="no such file"):
        parse_cluster(str(tmp_path / "nope.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{levels: 4}")
    with pytest.raises(ArtifactError, match="not valid JSON"):
        parse_cluster(str(bad))


@pytest.mark.parametrize("data, fragment", [
    ({"levels": []}, "levels: a cluster needs at least one level"),
    ({}, "levels: missing field"),
    ({"levels": [{"count": 0, "bandwidth": "1GB/s"}]}, "levels[0].count: must be >= 1"),
    ({"levels": [{"count": 2, "bandwidth": "1GB"}]}, "levels[0].bandwidth: bandwidth '1GB' is not understood"),
    ({"levels": [{"count": 2, "bandwidth": -5}]}, "levels[0].bandwidth: must be positive"),
    ({"levels": [{"count": 2}]}, "levels[0].bandwidth: missing field"),
    ({"levels": [{"count": 2, "bandwidth": "1GB/s", "jitter": 1}]}, "unknown field 'jitter'"),
    ({"levels": [{"count": 2, "bandwidth": "1GB/s", "latency": "soon"}]}, "levels[0].latency: latency 'soon' is not"),
    ({"levels": [{"count": 2, "bandwidth": "1GB/s", "latency": -1}]}, "levels[0].latency: must be 0 to 10 s"),
    ({"levels": [{"count": 2, "bandwidth": "1GB/s", "latency": "100s"}]}, "levels[0].latency: must be 0 to 10 s"),
    ({"levels": [{"count": 2, "bandwidth": "1GB/s"}], "memory": "lots"}, "memory: memory size 'lots'"),
    ({"levels": [{"count": 2, "bandwidth": "1GB/s"}], "memory": 1.5}, "memory: must be a whole number"),
    ({"levels": [{"count": 2, "bandwidth": "1GB/s"}], "schema": "pdtool.plan/1"}, "schema is 'pdtool.plan/1'"),
    ([1, 2], "expected an object"),
])
def test_json_errors_name_file_and_field(tmp_path, data, fragment):
    path = tmp_path / "c.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ArtifactError) as info:
        parse_cluster(str(path))
    message = str(info.value)
    assert "\n" not in message and message.startswith(str(path)) and fragment in message


@pytest.mark.parametrize("cluster", [
    parse_cluster("cluster-a"),
    parse_cluster("cluster-b:3", memory="12GB"),
    parse_cluster("4x12GB/s,4x10Gbit/s"),
    Cluster(levels=(Level(3, 1234567891.123), Level(2, 100.1)), memory=123_456_789),
])
def test_json_round_trip_is_exact(cluster, tmp_path):
    data = cluster.to_json()
    assert data["schema"] == SCHEMA
    again = Cluster.from_json(json.loads(canonical_json(data)))
    assert again == cluster
    path = tmp_path / "cluster.json"
    path.write_text(canonical_json(data))
    assert parse_cluster(str(path)) == cluster


def test_to_json_writes_units():
    assert parse_cluster("cluster-a").to_json() == {
        "schema": SCHEMA, "name": "cluster-a:4", "memory": "16 GiB",
        "levels": [{"count": 4, "bandwidth": "12 GB/s"}, {"count": 4, "bandwidth": "10 Gbit/s"}],
    }


# ----- describe --------------------------------------------------------------------------------------
def test_describe():
    assert parse_cluster("4x12GB/s,4x10Gbit/s", memory="16GiB").describe() == \
        "4x 12 GB/s, 4x 10 Gbit/s, 16 GiB per worker"
    assert parse_cluster("8x1.25e9B/s").describe() == "8x 10 Gbit/s, no memory limit"
    assert parse_cluster("cluster-a").describe() == "cluster-a:4 = 4x 12 GB/s, 4x 10 Gbit/s, 16 GiB per worker"
    assert parse_cluster("cluster-b:2").describe() == "cluster-b:2 = 8x 25 GB/s, 2x 25 Gbit/s, 16 GiB per worker"


@pytest.mark.parametrize("text, latencies", [
    ("2x10GB/s+100us", (1e-4,)),
    ("4x12GB/s + 5us, 4x10Gbit/s+0.1ms", (5e-6, 1e-4)),
    ("4x V100 @ 12 GB/s+2us", (2e-6,)),
    ("2x1e+9B/s", (0.0,)),  # an exponent's + is part of the bandwidth
])
def test_a_level_may_give_its_latency_after_a_plus_and_it_survives_json(text, latencies):
    cluster = parse_cluster(text)
    assert tuple(level.latency for level in cluster.levels) == pytest.approx(latencies)
    assert Cluster.from_json(cluster.to_json(), "x") == cluster
    assert ("latency" in cluster.to_json()["levels"][0]) == (latencies[0] > 0)  # files without latency stay as they were
    assert ("us" in cluster.describe()) == any(latencies)


@pytest.mark.parametrize("text, message", [
    ("2x10GB/s+5", "latency '5' is not understood; write a time with a unit after the \\+"),
    ("2x10GB/s + fast", "latency 'fast' is not understood"),
    ("2x10GB/s+11s", "latency must be 0 to 10 s"),
])
def test_a_bad_latency_is_one_line(text, message):
    with pytest.raises(PlanError, match=message):
        parse_cluster(text)


@pytest.mark.parametrize("text, seconds, shown", [
    ("100us", 1e-4, "100 us"), ("100 µs", 1e-4, "100 us"), ("0.1ms", 1e-4, "100 us"), ("2ms", 2e-3, "2 ms"),
    ("1e-4s", 1e-4, "100 us"), ("0s", 0.0, "0 ns"), ("1.5s", 1.5, "1.5 s"), ("250ns", 2.5e-7, "250 ns"),
])
def test_latencies_parse_show_and_write_back_exactly(text, seconds, shown):
    assert parse_duration(text) == pytest.approx(seconds)
    assert format_duration(parse_duration(text)) == shown
    assert parse_duration(exact_duration(parse_duration(text))) == parse_duration(text)


@pytest.mark.parametrize("text", ["100", "-1us", "fast", "1 hour", "infs", "1e400s"])
def test_a_latency_without_a_time_unit_or_finite_value_is_refused(text):
    with pytest.raises(PlanError, match="latency"):
        parse_duration(text)
