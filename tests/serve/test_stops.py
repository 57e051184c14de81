"""Stop sequences over streamed deltas: nothing of a stop sequence is ever shown."""

from kvchat.serve.stops import StopScanner


def run(stops, deltas):
    scanner = StopScanner(stops)
    shown = [scanner.feed(d) for d in deltas] + [scanner.flush()]
    return shown, scanner


def test_a_stop_split_across_deltas_is_held_back_then_dropped():
    shown, scanner = run(["END"], ["one E", "N", "D two"])
    assert "".join(shown) == "one " and scanner.hit
    assert all("E" not in s for s in shown)


def test_a_false_start_is_released():
    shown, scanner = run(["END"], ["an E", "gg"])
    assert "".join(shown) == "an Egg" and not scanner.hit


def test_no_stops_passes_everything_through():
    shown, scanner = run([], ["a", "b"])
    assert shown == ["a", "b", ""] and scanner.text == "ab"
