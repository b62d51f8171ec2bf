package cni

import "testing"

// IsHostVethName knows HostVethName's names, and none of weft's own links
// or another plugin's.
func TestIsHostVethName(t *testing.T) {
	for _, id := range []string{"a", "cnitool-1234", "0123456789abcdef0123456789abcdef"} {
		if n := HostVethName(id, "eth0"); !IsHostVethName(n) {
			t.Errorf("IsHostVethName(%q) = false for HostVethName(%q)", n, id)
		}
	}
	for _, n := range []string{"weft", "weft-tun", "weft-ipip", "weft-inproc", "weftABCDEF01234", "weft0123456789", "weft0123456789ab", "veth0123456789a", "eth0", ""} {
		if IsHostVethName(n) {
			t.Errorf("IsHostVethName(%q) = true", n)
		}
	}
}
