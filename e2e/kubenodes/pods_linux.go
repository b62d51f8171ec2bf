package kubenodes

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/weft-net/weft/e2e"
)

// PodNetns is the network namespace of a running netprobe pod, entered
// through its container's process (found by the POD_NAME in its
// environment), so that the harness can dial from inside the pod without
// exec through the API server.
func PodNetns(pod string) (*e2e.Netns, error) {
	procs, _ := filepath.Glob("/proc/[0-9]*")
	want := []byte("POD_NAME=" + pod + "\x00")
	for _, p := range procs {
		exe, err := os.Readlink(filepath.Join(p, "exe"))
		if err != nil || filepath.Base(exe) != "netprobe" {
			continue
		}
		env, err := os.ReadFile(filepath.Join(p, "environ"))
		if err != nil || !bytes.Contains(append([]byte{0}, env...), append([]byte{0}, want...)) {
			continue
		}
		pid, _ := strconv.Atoi(filepath.Base(p))
		return &e2e.Netns{Name: "pod " + pod, Path: fmt.Sprintf("/proc/%d/ns/net", pid)}, nil
	}
	return nil, fmt.Errorf("kubenodes: no netprobe process of pod %s on this machine", pod)
}

// Get fetches url from inside ns, within timeout, and returns the body.
func Get(ctx context.Context, ns *e2e.Netns, url string, timeout time.Duration) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	tr := &http.Transport{
		DisableKeepAlives: true,
		Proxy:             nil,
		DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
			var conn net.Conn
			var dialErr error
			if err := ns.Do(func() error {
				var d net.Dialer
				conn, dialErr = d.DialContext(ctx, network, addr)
				return nil
			}); err != nil {
				return nil, err
			}
			return conn, dialErr
		},
	}
	defer tr.CloseIdleConnections()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return "", err
	}
	resp, err := (&http.Client{Transport: tr}).Do(req)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 4096))
	if err != nil {
		return "", err
	}
	if resp.StatusCode != http.StatusOK {
		return "", fmt.Errorf("%s: %s", url, resp.Status)
	}
	return strings.TrimSpace(string(body)), nil
}
