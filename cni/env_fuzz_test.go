package cni

import (
	"errors"
	"strings"
	"testing"

	"github.com/containernetworking/cni/pkg/types"
)

// FuzzEnv feeds arbitrary CNI_CONTAINERID, CNI_IFNAME and CNI_ARGS (the
// runtime's environment) to the plugin's checks: they never panic, they
// fail only with a CNI error of code 4 (invalid environment variables),
// and what they accept is safe to use: an attachment that names a host
// veth of the right length and has no path separators, and pod names
// that come from CNI_ARGS.
func FuzzEnv(f *testing.F) {
	f.Add("0123456789abcdef", "eth0", "IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME=web-0")
	f.Add("cnitool-77383ca0a0715733ca6f", "net1", "K8S_POD_NAME=a;K8S_POD_NAME=b")
	f.Add("-x", "a/b", "x")
	f.Add("a", "..", "=;=")
	f.Add("a", "eth0", "IgnoreUnknown=true;FOO=bar")
	f.Add("a", "eth0", "K8S_POD_NAMESPACE=a=b;")
	f.Add("", "", "")
	f.Fuzz(func(t *testing.T, containerID, ifName, args string) {
		code := func(what string, err error) {
			t.Helper()
			var e *types.Error
			if !errors.As(err, &e) || e.Code != types.ErrInvalidEnvironmentVariables || e.Msg == "" {
				t.Fatalf("%s: error %v (%T) is not a CNI error of code %d with a message", what, err, err, types.ErrInvalidEnvironmentVariables)
			}
		}
		att, err := attachment(containerID, ifName)
		if err != nil {
			code("attachment", err)
		} else {
			if att.ContainerID != containerID || att.IfName != ifName {
				t.Fatalf("attachment %v from %q/%q", att, containerID, ifName)
			}
			if strings.ContainsAny(containerID+ifName, "/\x00") || ifName == "." || ifName == ".." {
				t.Fatalf("accepted a path-like attachment %q/%q", containerID, ifName)
			}
			if n := HostVethName(containerID, ifName); len(n) != 15 || !strings.HasPrefix(n, hostVethPrefix) {
				t.Fatalf("host veth name %q", n)
			}
		}
		ns, name, err := parsePodArgs(args)
		if err != nil {
			code("CNI_ARGS", err)
			return
		}
		for _, v := range []string{ns, name} {
			if v != "" && !strings.Contains(args, v) {
				t.Fatalf("pod field %q is not in CNI_ARGS %q", v, args)
			}
			if strings.Contains(v, ";") {
				t.Fatalf("pod field %q holds a separator", v)
			}
		}
	})
}
