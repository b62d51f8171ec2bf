package main

import (
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/weft-net/weft/tunnel"
)

// config is what the flags ask for, validated.
type config struct {
	dur        time.Duration
	streams    []int
	modes      []tunnel.Mode
	runs       int
	binDir     string
	routerArgs []string
	keep       bool // stay up after the table until Ctrl-C
	library    bool // measure the tunnel library in this process too
	podBase    bool // measure pods without weft over kernel VXLAN too
}

// parseFlags validates the flags and says what to give instead.
func parseFlags(dur time.Duration, streams, modes string, runs int) (config, error) {
	c := config{dur: dur, runs: runs}
	if dur < 2*time.Second || dur%time.Second != 0 {
		return c, fmt.Errorf("-time %s: give whole seconds, at least 2s (iperf3 -t; the first second is omitted)", dur)
	}
	if runs < 1 || runs > 100 {
		return c, fmt.Errorf("-runs %d: give 1 to 100 rounds", runs)
	}
	for _, s := range strings.Split(streams, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(s))
		if err != nil || n < 1 || n > 128 {
			return c, fmt.Errorf("-streams %q: give comma-separated stream counts from 1 to 128, e.g. 1,4", streams)
		}
		c.streams = append(c.streams, n)
	}
	for _, s := range strings.Split(modes, ",") {
		m := tunnel.Mode(strings.TrimSpace(s))
		if m != tunnel.ModeUDP && m != tunnel.ModeIPIP && m != tunnel.ModeVXLAN && m != tunnel.ModeAuto {
			return c, fmt.Errorf("-modes %q: each mode must be udp, ipip, vxlan or auto", modes)
		}
		if slices.Contains(c.modes, m) {
			return c, fmt.Errorf("-modes %q: %s is named twice", modes, m)
		}
		c.modes = append(c.modes, m)
	}
	if !slices.ContainsFunc(c.modes, func(m tunnel.Mode) bool { return !hasVXLAN(m) }) {
		return c, fmt.Errorf("-modes %q: name udp or ipip too: the kernel VXLAN baseline runs beside their routers (weft's vxlan and auto take port 4789 themselves)", modes)
	}
	return c, nil
}

// hasVXLAN reports whether routers with --encap m make weft-vx, which
// takes port 4789 in their namespaces (the baselines run elsewhere) and
// forwards in the kernel (no library control): vxlan, and auto, which
// picks it between two nodes without a password.
func hasVXLAN(m tunnel.Mode) bool { return m == tunnel.ModeVXLAN || m == tunnel.ModeAuto }
