package main

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"time"
)

// result is one measurement of one path.
type result struct {
	gbps    float64
	cpu     float64 // cores the forwarders used meanwhile
	retrans int
	load    float64 // 1-minute load average at the end
}

// row is one line of the table: a path and stream count over all rounds.
type row struct {
	name      string
	streams   int
	forwarded bool    // a userspace forwarder carries it: its CPU is reported
	gbps      float64 // median over the rounds
	cpu       float64 // median over the rounds
	retrans   int     // over all rounds
	loadMin   float64
	loadMax   float64
}

// summarize reduces the rounds of one path and stream count to a row.
func summarize(name string, forwarded bool, streams int, rs []result) row {
	r := row{name: name, streams: streams, forwarded: forwarded}
	var g, c []float64
	for i, x := range rs {
		g, c = append(g, x.gbps), append(c, x.cpu)
		r.retrans += x.retrans
		if i == 0 || x.load < r.loadMin {
			r.loadMin = x.load
		}
		r.loadMax = max(r.loadMax, x.load)
	}
	r.gbps, r.cpu = median(g), median(c)
	return r
}

// median of xs; 0 for none.
func median(xs []float64) float64 {
	s := slices.Clone(xs)
	slices.Sort(s)
	switch {
	case len(s) == 0:
		return 0
	case len(s)%2 == 1:
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

// tableInfo is what the line above the table says.
type tableInfo struct {
	took         time.Duration
	runs         int
	dur          time.Duration
	load0, load1 float64 // 1-minute load average at the start and the end
	routerArgs   []string
	now          time.Time
}

// Names of the baseline rows; the ratios divide by them.
const (
	underlayRow = "raw underlay (node to node)"
	vxlanRow    = "kernel VXLAN (node to node)"
)

// printTable writes the Markdown table for docs/benchmarks.md: every row
// with its ratio to the underlay, to kernel VXLAN and to the reference
// bridge plugin's pods over kernel VXLAN at the same stream count, and the forwarders' CPU: both routers' processes, or this
// process for the control paths.
func printTable(w io.Writer, rows []row, info tableInfo) {
	under, vx, pod := map[int]float64{}, map[int]float64{}, map[int]float64{}
	lmin, lmax := -1.0, 0.0
	for _, r := range rows {
		switch r.name {
		case underlayRow:
			under[r.streams] = r.gbps
		case vxlanRow:
			vx[r.streams] = r.gbps
		case podBridgeRow:
			pod[r.streams] = r.gbps
		}
		if lmin < 0 || r.loadMin < lmin {
			lmin = r.loadMin
		}
		lmax = max(lmax, r.loadMax)
	}
	if info.now.IsZero() {
		info.now = time.Now()
	}
	args := ""
	if len(info.routerArgs) > 0 {
		args = fmt.Sprintf("; routers given %q", strings.Join(info.routerArgs, " "))
	}
	fmt.Fprintf(w, "Measured %s (%s in all; each row the median of %d runs of %s; 1-minute load average %.1f at the start, %.1f–%.1f while measuring, on %s%s):\n\n",
		info.now.Format("2006-01-02"), info.took.Round(time.Second), info.runs, info.dur, info.load0, lmin, lmax, cpus(), args)
	fmt.Fprintln(w, "| path | streams | Gbit/s | of the underlay | of kernel VXLAN | of pods on kernel VXLAN | forwarder CPU (cores) | forwarder CPU per Gbit/s | TCP retransmits (all runs) |")
	fmt.Fprintln(w, "|---|---|---|---|---|---|---|---|---|")
	ratio := func(x, base float64) string {
		if base <= 0 {
			return "—"
		}
		return fmt.Sprintf("%.3f", x/base)
	}
	for _, r := range rows {
		cpu, per := "kernel", "kernel"
		if r.forwarded {
			cpu = fmt.Sprintf("%.2f", r.cpu)
			per = "—"
			if r.gbps > 0 {
				per = fmt.Sprintf("%.2f", r.cpu/r.gbps)
			}
		}
		fmt.Fprintf(w, "| %s | %d | %.2f | %s | %s | %s | %s | %s | %d |\n",
			r.name, r.streams, r.gbps, ratio(r.gbps, under[r.streams]), ratio(r.gbps, vx[r.streams]), ratio(r.gbps, pod[r.streams]), cpu, per, r.retrans)
	}
}

// cpus says how many cores the machine has.
func cpus() string { return fmt.Sprintf("%d cores", runtime.NumCPU()) }

// parseStatTicks returns utime + stime (fields 14 and 15) of a
// /proc/<pid>/stat line. The command name (field 2) may hold spaces and
// parentheses, so fields are counted after its last ')'.
func parseStatTicks(stat []byte) (uint64, error) {
	i := bytes.LastIndexByte(stat, ')')
	if i < 0 {
		return 0, errors.New("no ')' after the command name")
	}
	f := strings.Fields(string(stat[i+1:]))
	// f[0] is field 3 (state), so field k is f[k-3].
	if len(f) < 13 {
		return 0, fmt.Errorf("%d fields after the command name, want at least 13", len(f))
	}
	utime, err := strconv.ParseUint(f[11], 10, 64)
	if err != nil {
		return 0, fmt.Errorf("utime: %w", err)
	}
	stime, err := strconv.ParseUint(f[12], 10, 64)
	if err != nil {
		return 0, fmt.Errorf("stime: %w", err)
	}
	return utime + stime, nil
}
