package main

import (
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/weft-net/weft/tunnel"
)

func TestParseFlags(t *testing.T) {
	good, err := parseFlags(6*time.Second, "1, 4", "udp,ipip", 3)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(good.streams, []int{1, 4}) || !slices.Equal(good.modes, []tunnel.Mode{tunnel.ModeUDP, tunnel.ModeIPIP}) || good.runs != 3 || good.dur != 6*time.Second {
		t.Fatalf("parseFlags = %+v", good)
	}
	for _, tc := range []struct {
		dur             time.Duration
		streams, modes  string
		runs            int
		wantErrContains string
	}{
		{1 * time.Second, "1", "udp", 1, "-time"},
		{2500 * time.Millisecond, "1", "udp", 1, "-time"},
		{6 * time.Second, "0", "udp", 1, "-streams"},
		{6 * time.Second, "1,x", "udp", 1, "-streams"},
		{6 * time.Second, "", "udp", 1, "-streams"},
		{6 * time.Second, "1", "auto", 1, "udp or ipip too"},
		{6 * time.Second, "1", "vxlan,auto", 1, "udp or ipip too"},
		{6 * time.Second, "1", "udp,geneve", 1, "-modes"},
		{6 * time.Second, "1", "vxlan", 1, "udp or ipip too"},
		{6 * time.Second, "1", "udp,udp", 1, "named twice"},
		{6 * time.Second, "1", "udp", 0, "-runs"},
	} {
		_, err := parseFlags(tc.dur, tc.streams, tc.modes, tc.runs)
		if err == nil || !strings.Contains(err.Error(), tc.wantErrContains) {
			t.Errorf("parseFlags(%s, %q, %q, %d) = %v; want an error about %s", tc.dur, tc.streams, tc.modes, tc.runs, err, tc.wantErrContains)
		}
	}
}
