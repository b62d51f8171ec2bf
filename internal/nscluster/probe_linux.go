package nscluster

import (
	"bytes"
	"context"
	"fmt"
	"net/netip"
	"strings"
	"sync"
	"time"
)

const (
	// defaultPingWait bounds Ping when the context has no deadline.
	defaultPingWait = 10 * time.Second
	// matrixPairWait bounds each pair of PingMatrix.
	matrixPairWait = 3 * time.Second
	// matrixParallel is how many pings PingMatrix runs at once.
	matrixParallel = 8
)

// Ping runs `ping -c 1 -W 1 <addr>` inside from until one answer comes back or
// ctx ends (10s when ctx has no deadline). The error carries the last try's
// output.
func Ping(ctx context.Context, from *Netns, addr netip.Addr) error {
	return PingFrom(ctx, from, netip.Addr{}, addr)
}

// PingFrom is Ping with the source address src (ping -I), when valid.
func PingFrom(ctx context.Context, from *Netns, src, addr netip.Addr) error {
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, defaultPingWait)
		defer cancel()
	}
	argv := []string{"ping", "-n", "-c", "1", "-W", "1"}
	what := addr.String()
	if src.IsValid() {
		argv = append(argv, "-I", src.String())
		what = fmt.Sprintf("%s from %s", addr, src)
	}
	argv = append(argv, addr.String())
	var last error
	var out []byte
	err := pollUntil(ctx, time.Hour, 200*time.Millisecond, func() bool {
		out, last = from.Exec(ctx, argv...)
		return last == nil
	})
	if err != nil {
		return fmt.Errorf("e2e: ping from %s to %s: %w (last try: %v: %s)", from.Name, what, err, last, bytes.TrimSpace(out))
	}
	return nil
}

// PingMatrix pings every pod from every other pod (each pair for up to 3s,
// several pairs at once) and returns who reached whom. Print it for a
// picture; AllOK and Failures for a test.
//
// An answer from an address that several pods hold proves nothing (the
// nearest holder answers), so such pairs, and pods without an address, are
// not pinged but marked failed, with a note in Problems.
func PingMatrix(ctx context.Context, pods []*Pod) *Matrix {
	names := make([]string, len(pods))
	holders := map[netip.Addr][]string{}
	for i, p := range pods {
		names[i] = p.String()
		holders[p.IP] = append(holders[p.IP], names[i])
	}
	m := NewMatrix(names)
	for i, p := range pods {
		h := holders[p.IP]
		switch {
		case !p.IP.IsValid():
			m.Problems = append(m.Problems, names[i]+" has no address (not attached?)")
		case len(h) > 1 && h[0] == names[i]:
			m.Problems = append(m.Problems, fmt.Sprintf("%s share the address %s", strings.Join(h, ", "), p.IP))
		}
	}
	sem := make(chan struct{}, matrixParallel)
	var wg sync.WaitGroup
	for i, from := range pods {
		for j, to := range pods {
			if i == j || !to.IP.IsValid() || len(holders[to.IP]) > 1 {
				continue
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				sem <- struct{}{}
				defer func() { <-sem }()
				pctx, cancel := context.WithTimeout(ctx, matrixPairWait)
				defer cancel()
				m.OK[i][j] = Ping(pctx, from.NS, to.IP) == nil
			}()
		}
	}
	wg.Wait()
	return m
}
