package cni

import (
	"errors"
	"log/slog"
	"slices"
	"strings"
	"testing"

	"github.com/containernetworking/cni/pkg/types"

	"github.com/weft-net/weft/api"
)

// cniCode is the CNI error code of err, or 0 when err is not a *types.Error.
func cniCode(err error) uint {
	var e *types.Error
	if errors.As(err, &e) {
		return e.Code
	}
	return 0
}

func TestParseConfig(t *testing.T) {
	long := "/" + strings.Repeat("s", maxSocketPath)
	tests := []struct {
		name     string
		in       string
		wantCode uint   // 0: success
		wantMsg  string // a part of the error message
		check    func(t *testing.T, c *NetConf)
	}{
		{
			name: "minimal gets the default socket",
			in:   `{"cniVersion":"1.0.0","name":"weft","type":"weft-cni"}`,
			check: func(t *testing.T, c *NetConf) {
				if c.Socket != api.DefaultSocket || c.LogFile != "" || c.Level() != slog.LevelInfo {
					t.Errorf("got socket %q logFile %q level %v", c.Socket, c.LogFile, c.Level())
				}
			},
		},
		{
			name: "all fields",
			in:   `{"cniVersion":"1.1.0","name":"weft","type":"weft-cni","socket":"/run/w/s.sock","logFile":"/var/log/weft-cni.log","logLevel":"debug"}`,
			check: func(t *testing.T, c *NetConf) {
				if c.Socket != "/run/w/s.sock" || c.LogFile != "/var/log/weft-cni.log" || c.Level() != slog.LevelDebug {
					t.Errorf("got %+v", c)
				}
			},
		},
		{
			name: "unknown fields are ignored",
			in:   `{"cniVersion":"0.4.0","name":"weft","type":"weft-cni","whatever":{"a":[1,2]},"capabilities":{"portMappings":true},"runtimeConfig":{}}`,
		},
		{name: "0.3.0", in: `{"cniVersion":"0.3.0","name":"weft"}`},
		{name: "0.3.1", in: `{"cniVersion":"0.3.1","name":"weft"}`},
		{
			name: "gc attachments",
			in:   `{"cniVersion":"1.1.0","name":"weft","cni.dev/valid-attachments":[{"containerID":"abc","ifname":"eth0"}]}`,
			check: func(t *testing.T, c *NetConf) {
				got, err := validAttachments(c)
				if err != nil || len(got) != 1 || got[0] != (api.Attachment{ContainerID: "abc", IfName: "eth0"}) {
					t.Errorf("valid attachments %v, %v", got, err)
				}
			},
		},
		{
			name: "prevResult is parsed",
			in: `{"cniVersion":"1.0.0","name":"weft","prevResult":{"cniVersion":"1.0.0",
				"interfaces":[{"name":"weftabc"},{"name":"eth0","sandbox":"/var/run/netns/p"}],
				"ips":[{"address":"10.32.0.5/12","gateway":"10.32.0.1","interface":1}]}}`,
			check: func(t *testing.T, c *NetConf) {
				if c.PrevResult == nil {
					t.Error("PrevResult not parsed")
				}
			},
		},
		{name: "empty", in: "", wantCode: types.ErrDecodingFailure, wantMsg: "empty"},
		{name: "white space", in: " \n", wantCode: types.ErrDecodingFailure, wantMsg: "empty"},
		{name: "not JSON", in: `{"cniVersion":`, wantCode: types.ErrDecodingFailure, wantMsg: "not valid JSON"},
		{name: "array", in: `[1]`, wantCode: types.ErrDecodingFailure, wantMsg: "not valid JSON"},
		{name: "socket not a string", in: `{"cniVersion":"1.0.0","name":"weft","socket":7}`, wantCode: types.ErrDecodingFailure, wantMsg: "socket"},
		{name: "no name", in: `{"cniVersion":"1.0.0"}`, wantCode: types.ErrInvalidNetworkConfig, wantMsg: `"name"`},
		{name: "no version", in: `{"name":"weft"}`, wantCode: types.ErrIncompatibleCNIVersion, wantMsg: "cniVersion"},
		{name: "old version", in: `{"cniVersion":"0.2.0","name":"weft"}`, wantCode: types.ErrIncompatibleCNIVersion, wantMsg: "0.3.0, 0.3.1, 0.4.0, 1.0.0, 1.1.0"},
		{name: "relative socket", in: `{"cniVersion":"1.0.0","name":"weft","socket":"weft.sock"}`, wantCode: types.ErrInvalidNetworkConfig, wantMsg: "absolute"},
		{name: "NUL in socket", in: `{"cniVersion":"1.0.0","name":"weft","socket":"/run/\u0000x"}`, wantCode: types.ErrInvalidNetworkConfig, wantMsg: "NUL"},
		{name: "long socket", in: `{"cniVersion":"1.0.0","name":"weft","socket":"` + long + `"}`, wantCode: types.ErrInvalidNetworkConfig, wantMsg: "at most 107"},
		{name: "relative log file", in: `{"cniVersion":"1.0.0","name":"weft","logFile":"x.log"}`, wantCode: types.ErrInvalidNetworkConfig, wantMsg: "logFile"},
		{name: "bad log level", in: `{"cniVersion":"1.0.0","name":"weft","logLevel":"loud"}`, wantCode: types.ErrInvalidNetworkConfig, wantMsg: "debug, info, warn or error"},
		{name: "ipam section", in: `{"cniVersion":"1.0.0","name":"weft","ipam":{"type":"host-local"}}`, wantCode: types.ErrInvalidNetworkConfig, wantMsg: "remove it"},
		{
			name:     "bad prevResult",
			in:       `{"cniVersion":"1.0.0","name":"weft","prevResult":{"ips":[{"address":"nonsense"}]}}`,
			wantCode: types.ErrDecodingFailure, wantMsg: "prevResult",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, err := ParseConfig([]byte(tt.in))
			if tt.wantCode == 0 {
				if err != nil {
					t.Fatalf("ParseConfig: %v", err)
				}
				if tt.check != nil {
					tt.check(t, c)
				}
				return
			}
			if err == nil {
				t.Fatalf("ParseConfig succeeded, want code %d", tt.wantCode)
			}
			if got := cniCode(err); got != tt.wantCode {
				t.Errorf("code %d, want %d (%v)", got, tt.wantCode, err)
			}
			if !strings.Contains(err.Error(), tt.wantMsg) {
				t.Errorf("error %q does not mention %q", err, tt.wantMsg)
			}
		})
	}
}

func TestValidAttachmentsRefusesGarbage(t *testing.T) {
	c, err := ParseConfig([]byte(`{"cniVersion":"1.1.0","name":"weft","cni.dev/valid-attachments":[{"containerID":"ok","ifname":"eth0"},{"containerID":"","ifname":"eth0"}]}`))
	if err != nil {
		t.Fatal(err)
	}
	_, err = validAttachments(c)
	if cniCode(err) != types.ErrInvalidNetworkConfig || !strings.Contains(err.Error(), "entry 1") {
		t.Fatalf("got %v, want an invalid-config error naming entry 1", err)
	}
}

func TestParsePodArgs(t *testing.T) {
	ns, name, err := parsePodArgs("IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME=web-0;K8S_POD_INFRA_CONTAINER_ID=abc;K8S_POD_UID=u")
	if err != nil || ns != "default" || name != "web-0" {
		t.Fatalf("got %q %q %v", ns, name, err)
	}
	if ns, name, err := parsePodArgs(""); err != nil || ns != "" || name != "" {
		t.Fatalf("empty CNI_ARGS: got %q %q %v", ns, name, err)
	}
	if _, _, err := parsePodArgs("garbage"); cniCode(err) != types.ErrInvalidEnvironmentVariables || !strings.Contains(err.Error(), "CNI_ARGS") {
		t.Fatalf("garbage CNI_ARGS: got %v", err)
	}
}

func TestAttachmentValidation(t *testing.T) {
	for _, tt := range []struct{ id, ifName, want string }{
		{"", "eth0", "CNI_CONTAINERID"},
		{"-abc", "eth0", "must start"},
		{"abc", "", "CNI_IFNAME"},
		{"abc", "a-very-long-interface-name", "longer than 15"},
	} {
		_, err := attachment(tt.id, tt.ifName)
		if cniCode(err) != types.ErrInvalidEnvironmentVariables || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("attachment(%q, %q) = %v, want code 4 mentioning %q", tt.id, tt.ifName, err, tt.want)
		}
	}
}

// FuzzParseConfig feeds arbitrary stdin to the parser: it never panics, it
// fails only with a CNI error that says something, and what it accepts is
// usable.
func FuzzParseConfig(f *testing.F) {
	for _, s := range []string{
		`{"cniVersion":"1.0.0","name":"weft","type":"weft-cni","socket":"/run/weft/weft.sock"}`,
		`{"cniVersion":"1.1.0","name":"weft","logFile":"/tmp/x","logLevel":"DEBUG+2"}`,
		`{"cniVersion":"1.1.0","name":"weft","cni.dev/valid-attachments":[{"containerID":"a","ifname":"eth0"}]}`,
		`{"cniVersion":"0.3.1","name":"weft","prevResult":{"cniVersion":"0.3.1","interfaces":[{"name":"eth0"}],"ips":[{"version":"4","address":"10.32.0.5/12","interface":0}]}}`,
		`{"cniVersion":"0.4.0","name":"weft","prevResult":{"ips":[{"address":"10.32.0.5/12","interface":-3}],"routes":[{"dst":"0.0.0.0/0"}]}}`,
		`{"cniVersion":"1.0.0","name":"weft","prevResult":{"cniVersion":"0.2.0","ip4":{"ip":"10.0.0.1/8"}}}`,
		`{"cniVersion":"1.0.0","name":"weft","ipam":{"type":"x"}}`,
		`{"name":"weft"}`,
		`{`,
		``,
		`null`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, in []byte) {
		c, err := ParseConfig(in)
		if err != nil {
			var e *types.Error
			if !errors.As(err, &e) || e.Msg == "" {
				t.Fatalf("error %v (%T) is not a CNI error with a message", err, err)
			}
			if !slices.Contains([]uint{types.ErrDecodingFailure, types.ErrInvalidNetworkConfig, types.ErrIncompatibleCNIVersion}, e.Code) {
				t.Fatalf("unexpected code %d: %v", e.Code, e)
			}
			return
		}
		if c.Name == "" || !strings.HasPrefix(c.Socket, "/") || !slices.Contains(specVersions, c.CNIVersion) {
			t.Fatalf("accepted an unusable config: %+v", c)
		}
	})
}
