package api

import (
	"encoding/json"
	"net/netip"
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

// The typed addresses keep the wire format: text in JSON, as before.
func TestAllocationJSON(t *testing.T) {
	a := Allocation{Attachment: Attachment{ContainerID: "c", IfName: "eth0"},
		Address: netip.MustParsePrefix("10.32.0.5/12"), Gateway: netip.MustParseAddr("10.32.0.1"), Bridge: "weft", MTU: 1376, New: true}
	b, err := json.Marshal(a)
	if err != nil {
		t.Fatal(err)
	}
	want := `{"containerID":"c","ifName":"eth0","address":"10.32.0.5/12","gateway":"10.32.0.1","bridge":"weft","mtu":1376,"new":true}`
	if string(b) != want {
		t.Errorf("JSON %s, want %s", b, want)
	}
	var back Allocation
	if err := json.Unmarshal(b, &back); err != nil || back != a {
		t.Errorf("back: %+v, %v", back, err)
	}
	for _, bad := range []string{`{"address":"10.32.0.5"}`, `{"address":"x/12"}`, `{"gateway":"10.32.0.1/12"}`} {
		if err := json.Unmarshal([]byte(bad), &back); err == nil {
			t.Errorf("%s decoded", bad)
		}
	}
	if b, _ := json.Marshal(ReleaseResponse{}); string(b) != `{"released":false}` {
		t.Errorf("release without an address: %s", b)
	}
	if b, _ := json.Marshal(ReleaseResponse{Released: true, Address: netip.MustParseAddr("10.32.0.5")}); string(b) != `{"released":true,"address":"10.32.0.5"}` {
		t.Errorf("release: %s", b)
	}
}
