"""What a plan will do, computed without running it: the event simulator of its schedule
(`simulate`), the closed form of its steady state (`steady`), and the prediction a run is
compared with (`prediction`: the time and memory `pd train` prints beside what it measured).
Pure: no torch."""
