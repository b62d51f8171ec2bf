//go:build linux

package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"strings"
	"testing"

	cniversion "github.com/containernetworking/cni/pkg/version"
	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/containernetworking/plugins/pkg/testutils"
	"github.com/vishvananda/netlink"

	"github.com/weft-net/weft/api"
	"github.com/weft-net/weft/cni/routertest"
)

// newNS makes a network namespace that is removed when the test ends.
func newNS(t *testing.T) ns.NetNS {
	t.Helper()
	n, err := testutils.NewNS()
	if err != nil {
		t.Fatalf("making a network namespace: %v", err)
	}
	t.Cleanup(func() {
		n.Close()
		if _, err := os.Stat(n.Path()); errors.Is(err, os.ErrNotExist) {
			return
		}
		if err := testutils.UnmountNS(n); err != nil {
			t.Errorf("removing namespace %s: %v", n.Path(), err)
		}
	})
	return n
}

// TestBinaryAddCheckDel drives the plugin binary the way a runtime does
// (environment, stdin, stdout), from a "node" namespace with a bridge.
func TestBinaryAddCheckDel(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: the test makes network namespaces, veths and a bridge")
	}
	node, pod, pod2 := newNS(t), newNS(t), newNS(t)
	if err := node.Do(func(ns.NetNS) error {
		attrs := netlink.NewLinkAttrs()
		attrs.Name = "weft"
		br := &netlink.Bridge{LinkAttrs: attrs}
		if err := netlink.LinkAdd(br); err != nil {
			return err
		}
		addr, _ := netlink.ParseAddr("10.32.0.1/12")
		if err := netlink.AddrAdd(br, addr); err != nil {
			return err
		}
		return netlink.LinkSetUp(br)
	}); err != nil {
		t.Fatal(err)
	}
	router := routertest.Start(t, "weft", 1400)

	// run runs one command from the node namespace: the child process forks
	// from the locked thread, so it starts there.
	run := func(command, id string, pod ns.NetNS, cniVersion, prevResult string) (string, string, int) {
		t.Helper()
		conf := fmt.Sprintf(`{"cniVersion":%q,"name":"weft","type":"weft-cni","socket":%q`, cniVersion, router.Socket)
		if prevResult != "" {
			conf += `,"prevResult":` + prevResult
		}
		conf += "}"
		var out, errOut string
		var code int
		if err := node.Do(func(ns.NetNS) error {
			out, errOut, code = runPlugin(t, conf, "CNI_COMMAND="+command, "CNI_CONTAINERID="+id,
				"CNI_NETNS="+pod.Path(), "CNI_IFNAME=eth0", "CNI_PATH=/opt/cni/bin",
				"CNI_ARGS=IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME=web-0")
			return nil
		}); err != nil {
			t.Fatal(err)
		}
		return out, errOut, code
	}

	out, errOut, code := run("ADD", "cnitool-one", pod, "1.0.0", "")
	if code != 0 {
		t.Fatalf("ADD exited %d: %s %s", code, out, errOut)
	}
	res, err := cniversion.NewResult("1.0.0", []byte(out))
	if err != nil {
		t.Fatalf("ADD printed %q: %v", out, err)
	}
	if !strings.Contains(out, `"10.32.0.2/12"`) || errOut != "" {
		t.Fatalf("ADD result %s, stderr %q", res, errOut)
	}
	if out, errOut, code := run("CHECK", "cnitool-one", pod, "1.0.0", out); code != 0 || out != "" {
		t.Fatalf("CHECK exited %d: stdout %q stderr %q", code, out, errOut)
	}

	// An older runtime asks for 0.3.1 and gets a 0.3.1 result.
	out31, errOut, code := run("ADD", "cnitool-two", pod2, "0.3.1", "")
	var r31 struct {
		CNIVersion string `json:"cniVersion"`
		IPs        []struct {
			Version string `json:"version"`
			Address string `json:"address"`
		} `json:"ips"`
	}
	if code != 0 || json.Unmarshal([]byte(out31), &r31) != nil || r31.CNIVersion != "0.3.1" ||
		len(r31.IPs) != 1 || r31.IPs[0].Version != "4" || r31.IPs[0].Address != "10.32.0.3/12" {
		t.Fatalf("0.3.1 ADD exited %d: %s %s", code, out31, errOut)
	}

	for id, pod := range map[string]ns.NetNS{"cnitool-one": pod, "cnitool-two": pod2} {
		for range 2 {
			if out, errOut, code := run("DEL", id, pod, "1.0.0", ""); code != 0 || out != "" {
				t.Fatalf("DEL %s exited %d: stdout %q stderr %q", id, code, out, errOut)
			}
		}
		if _, ok := router.Allocation(api.Attachment{ContainerID: id, IfName: "eth0"}); ok {
			t.Fatalf("DEL left the address of %s", id)
		}
	}
}
