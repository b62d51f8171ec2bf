package api

import (
	"strings"
	"testing"
)

func TestValidateContainerID(t *testing.T) {
	for _, ok := range []string{"a", "0123456789abcdef", "cnitool-77383ca0a0715733ca6f", "pod_1.x-y", strings.Repeat("a", MaxContainerIDLen)} {
		if err := ValidateContainerID(ok); err != nil {
			t.Errorf("ValidateContainerID(%q): %v", ok, err)
		}
	}
	for bad, want := range map[string]string{
		"":                                       "empty",
		strings.Repeat("a", MaxContainerIDLen+1): "characters long",
		"-abc":                                   "start with a letter or digit",
		"_weft_gateway":                          "start with a letter or digit",
		"a/b":                                    "'/'",
		"a b":                                    "' '",
		"ü":                                      "start with",
	} {
		err := ValidateContainerID(bad)
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("ValidateContainerID(%q) = %v, want an error containing %q", bad, err, want)
		}
	}
}

func TestValidateIfName(t *testing.T) {
	for _, ok := range []string{"eth0", "net1", strings.Repeat("e", 15)} {
		if err := ValidateIfName(ok); err != nil {
			t.Errorf("ValidateIfName(%q): %v", ok, err)
		}
	}
	for _, bad := range []string{"", ".", "..", strings.Repeat("e", 16), "a/b", "a:b", "a b", "\x00", "eth\x000", "a\rb", "a\vb"} {
		if err := ValidateIfName(bad); err == nil {
			t.Errorf("ValidateIfName(%q) accepted", bad)
		}
	}
}
