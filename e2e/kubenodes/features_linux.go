package kubenodes

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"os"
	"strings"
)

// ErrHostFeature is what New returns (wrapped, naming each one) when this
// machine's kernel lacks something the real-node cluster needs; the tests
// skip on it. Missing programs (containerd, runc, nft, ...) are not in
// this class: `make deps-kube` (a dependency of make test and make
// e2e-kube) installs them, and their absence fails.
var ErrHostFeature = errors.New("kubenodes: this machine lacks a kernel feature the real-node cluster needs")

// checkHostFeatures says which of the kernel features the nodes need are
// missing: overlayfs (each node's /etc, containerd's snapshotter), a
// mounted cgroup hierarchy (the kubelets' and containers' cgroups) and
// /dev/net/tun (weft's udp encapsulation). Network namespaces, veth,
// bridges and nftables are checked by the harness that makes the
// underlay (e2e), which skips the same way where they are missing.
func checkHostFeatures() error {
	var missing []string
	fss, err := os.ReadFile("/proc/filesystems")
	if err != nil {
		return fmt.Errorf("kubenodes: %w", err)
	}
	have := map[string]bool{}
	sc := bufio.NewScanner(bytes.NewReader(fss))
	for sc.Scan() {
		if f := strings.Fields(sc.Text()); len(f) > 0 {
			have[f[len(f)-1]] = true
		}
	}
	if !have["overlay"] {
		missing = append(missing, "overlayfs (not in /proc/filesystems): the nodes' /etc and containerd's overlayfs snapshotter")
	}
	if hier, err := hierarchies(); err != nil || len(hier) == 0 {
		missing = append(missing, fmt.Sprintf("a mounted cgroup hierarchy under %s (%v): the kubelets' and the containers' cgroups", cgroupBase, err))
	}
	if _, err := os.Stat("/dev/net/tun"); err != nil {
		missing = append(missing, "/dev/net/tun: weft's udp encapsulation")
	}
	if len(missing) > 0 {
		return fmt.Errorf("%w: %s", ErrHostFeature, strings.Join(missing, "; "))
	}
	return nil
}
