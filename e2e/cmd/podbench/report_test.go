package main

import (
	"strings"
	"testing"
	"time"
)

func TestMedian(t *testing.T) {
	for _, tc := range []struct {
		in   []float64
		want float64
	}{
		{nil, 0},
		{[]float64{3}, 3},
		{[]float64{3, 1, 2}, 2},
		{[]float64{4, 1, 3, 2}, 2.5},
	} {
		if got := median(tc.in); got != tc.want {
			t.Errorf("median(%v) = %v, want %v", tc.in, got, tc.want)
		}
	}
	in := []float64{3, 1, 2}
	median(in)
	if in[0] != 3 {
		t.Error("median sorted its input in place")
	}
}

func TestParseStatTicks(t *testing.T) {
	// Fields 14 and 15 (utime, stime) are 250 and 75; the command name holds
	// a space and a ')' to trip naive splitting.
	stat := "4242 (we ft) x) S 1 4242 4242 0 -1 4194560 100 0 0 0 250 75 0 0 20 0 9 0 12345 0 0\n"
	got, err := parseStatTicks([]byte(stat))
	if err != nil || got != 325 {
		t.Fatalf("parseStatTicks = %d, %v; want 325", got, err)
	}
	for _, bad := range []string{"", "4242 weft S 1", "4242 (weft) S 1 2 3", "4242 (weft) S 1 4242 4242 0 -1 4194560 100 0 0 0 x 75 0"} {
		if _, err := parseStatTicks([]byte(bad)); err == nil {
			t.Errorf("parseStatTicks(%q) accepted a bad line", bad)
		}
	}
}

func TestSummarize(t *testing.T) {
	r := summarize("p", true, 4, []result{
		{gbps: 3, cpu: 0.9, retrans: 2, load: 5},
		{gbps: 1, cpu: 0.7, retrans: 3, load: 9},
		{gbps: 2, cpu: 0.8, retrans: 0, load: 7},
	})
	if r.gbps != 2 || r.cpu != 0.8 || r.retrans != 5 || r.loadMin != 5 || r.loadMax != 9 || !r.forwarded || r.streams != 4 {
		t.Fatalf("summarize = %+v", r)
	}
}

func TestPrintTable(t *testing.T) {
	rows := []row{
		{name: underlayRow, streams: 1, gbps: 8, loadMin: 3, loadMax: 4},
		{name: vxlanRow, streams: 1, gbps: 4, loadMin: 3, loadMax: 4},
		{name: podBridgeRow, streams: 1, gbps: 3.2, loadMin: 3, loadMax: 4},
		{name: "weft udp", streams: 1, gbps: 2, cpu: 0.5, forwarded: true, retrans: 7, loadMin: 3, loadMax: 4},
		{name: "weft udp", streams: 4, gbps: 2, cpu: 0.5, forwarded: true, loadMin: 3, loadMax: 4},
	}
	var b strings.Builder
	printTable(&b, rows, tableInfo{took: 90 * time.Second, runs: 3, dur: 6 * time.Second, load0: 2.5, now: time.Date(2026, 11, 30, 0, 0, 0, 0, time.UTC)})
	out := b.String()
	for _, want := range []string{
		"Measured 2026-11-30 (1m30s in all; each row the median of 3 runs of 6s; 1-minute load average 2.5 at the start, 3.0–4.0 while measuring",
		"| " + underlayRow + " | 1 | 8.00 | 1.000 | 2.000 | 2.500 | kernel | kernel | 0 |",
		"| " + vxlanRow + " | 1 | 4.00 | 0.500 | 1.000 | 1.250 | kernel | kernel | 0 |",
		"| " + podBridgeRow + " | 1 | 3.20 | 0.400 | 0.800 | 1.000 | kernel | kernel | 0 |",
		"| weft udp | 1 | 2.00 | 0.250 | 0.500 | 0.625 | 0.50 | 0.25 | 7 |",
		"| weft udp | 4 | 2.00 | — | — | — | 0.50 | 0.25 | 0 |", // no baseline at 4 streams
	} {
		if !strings.Contains(out, want) {
			t.Errorf("table lacks %q:\n%s", want, out)
		}
	}
}
