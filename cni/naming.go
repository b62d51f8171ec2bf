package cni

import (
	"crypto/sha256"
	"encoding/hex"
	"strings"
)

// hostVethPrefix starts the name of every host end of a pod veth.
const hostVethPrefix = "weft"

// hostVethHashLen is how many hex characters of the hash follow the prefix:
// 4 + 11 = 15, the longest interface name Linux takes.
const hostVethHashLen = 11

// HostVethName is the name of the host end of the veth of one attachment:
// "weft" and the first 11 hex characters of sha256(containerID + "/" + ifName).
// It is stable across ADD, CHECK and DEL, and never cuts the container id, so
// runtimes whose ids share a long prefix (cnitool's "cnitool-…") do not
// collide as they did with Weave's 7-character truncation.
func HostVethName(containerID, ifName string) string {
	sum := sha256.Sum256([]byte(containerID + "/" + ifName))
	return hostVethPrefix + hex.EncodeToString(sum[:])[:hostVethHashLen]
}

// IsHostVethName reports whether name has the form HostVethName gives:
// "weft" and 11 lowercase hex characters (weft's own links, "weft",
// "weft-tun", "weft-ipip", do not).
func IsHostVethName(name string) bool {
	rest, ok := strings.CutPrefix(name, hostVethPrefix)
	if !ok || len(rest) != hostVethHashLen {
		return false
	}
	for _, c := range rest {
		if !('0' <= c && c <= '9' || 'a' <= c && c <= 'f') {
			return false
		}
	}
	return true
}
