package cni

import (
	"regexp"
	"strings"
	"testing"

	"github.com/weft-net/weft/api"
)

func TestHostVethName(t *testing.T) {
	// Golden: "weft" + sha256("abc/eth0")[:11], so the name never changes
	// between plugin versions (DEL after an upgrade finds the veth of ADD).
	if got, want := HostVethName("abc", "eth0"), "weft538f587a236"; got != want {
		t.Fatalf("HostVethName = %q, want %q", got, want)
	}
	valid := regexp.MustCompile(`^weft[0-9a-f]{11}$`)
	// cnitool's ids share a long prefix; Weave's 7 characters collided on them.
	prefix := "cnitool-" + strings.Repeat("7", 40)
	seen := map[string]string{}
	for _, id := range []string{prefix + "a", prefix + "b", prefix + "aa", prefix, "cnitool-1", "cnitool-2"} {
		for _, ifName := range []string{"eth0", "eth1", "net1"} {
			n := HostVethName(id, ifName)
			if !valid.MatchString(n) || len(n) > api.MaxIfNameLen {
				t.Fatalf("HostVethName(%q, %q) = %q: not weft + 11 hex characters", id, ifName, n)
			}
			if err := api.ValidateIfName(n); err != nil {
				t.Fatal(err)
			}
			if n != HostVethName(id, ifName) {
				t.Fatalf("HostVethName(%q, %q) is not stable", id, ifName)
			}
			key := id + "/" + ifName
			if other, dup := seen[n]; dup {
				t.Fatalf("%s and %s both get %s", other, key, n)
			}
			seen[n] = key
		}
	}
	// The separator keeps ("ab", "c…") and ("a", "bc…") apart.
	if HostVethName("ab", "ceth0") == HostVethName("abc", "eth0") {
		t.Fatal("container id and ifname run together")
	}
}
