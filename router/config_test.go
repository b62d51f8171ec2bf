package router

import (
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/weft-net/weft/tunnel"
)

func validConfig(t testing.TB) Config {
	c := Defaults()
	dir := t.TempDir()
	c.StateDir, c.Socket, c.CNIBinDir, c.CNIConfDir = dir+"/state", dir+"/weft.sock", dir+"/bin", dir+"/conf"
	return c
}

func TestValidate(t *testing.T) {
	if _, err := Defaults().Validate(); err != nil {
		t.Fatalf("defaults do not validate: %v", err)
	}
	for _, tc := range []struct {
		name   string
		mutate func(*Config)
		want   string // substring of the error
	}{
		{"range not a CIDR", func(c *Config) { c.IPAllocRange = "10.32.0.0" }, "--ipalloc-range"},
		{"range IPv6", func(c *Config) { c.IPAllocRange = "fd00::/64" }, "IPv6"},
		{"range too small", func(c *Config) { c.IPAllocRange = "10.32.0.0/30" }, "prefix length"},
		{"init unknown", func(c *Config) { c.IPAllocInit = "paxos" }, "--ipalloc-init"},
		{"init consensus=0", func(c *Config) { c.IPAllocInit = "consensus=0" }, "consensus=N"},
		{"init seed empty", func(c *Config) { c.IPAllocInit = "seed=" }, "seed="},
		{"encap", func(c *Config) { c.Encap = "sleeve" }, "--encap"},
		{"vxlan with a password", func(c *Config) { c.Encap, c.Password = "vxlan", "a-long-enough-pw" }, "--trusted-subnets"},
		{"vxlan vni 0", func(c *Config) { c.Encap, c.VXLANVNI = "vxlan", 0 }, "--vxlan-vni"},
		{"vxlan vni too big", func(c *Config) { c.Encap, c.VXLANVNI = "vxlan", 1<<24 }, "--vxlan-vni"},
		{"vxlan port 0", func(c *Config) { c.Encap, c.VXLANPort = "vxlan", 0 }, "--vxlan-port"},
		{"vxlan port is the data port", func(c *Config) { c.Encap, c.VXLANPort = "vxlan", c.DataPort }, "--vxlan-port"},
		{"auto: vxlan port is the gossip port", func(c *Config) { c.Encap, c.VXLANPort = "auto", c.Port }, "--vxlan-port"},
		{"log level", func(c *Config) { c.LogLevel = "loud" }, "--log-level"},
		{"gc grace negative", func(c *Config) { c.GCGrace = -time.Second }, "--gc-grace"},
		{"gc grace too long", func(c *Config) { c.GCGrace = 2 * time.Hour }, "--gc-grace"},
		{"host", func(c *Config) { c.Host = "node1" }, "--host"},
		{"port", func(c *Config) { c.Port = 0 }, "--port"},
		{"mtu", func(c *Config) { c.MTU = 10 }, "--mtu"},
		{"relative state dir", func(c *Config) { c.StateDir = "state" }, "--state-dir"},
		{"socket too long", func(c *Config) { c.Socket = "/" + strings.Repeat("s", 120) }, "107 bytes"},
		{"bridge name too long", func(c *Config) { c.Bridge = "a-very-long-bridge" }, "--bridge"},
		{"name with space", func(c *Config) { c.Name = "a b" }, "--name"},
		{"http addr", func(c *Config) { c.HTTPAddr = "6784" }, "--http-addr"},
		{"password file missing", func(c *Config) { c.PasswordFile = "/nonexistent/pw" }, "--password-file"},
		{"password short", func(c *Config) { c.Password = "short" }, "at least 12"},
		{"password twice", func(c *Config) { c.Password = "a-long-enough-pw"; c.PasswordFile = "/etc/hostname" }, "only one"},
		{"trusted subnet", func(c *Config) { c.TrustedSubnets = "10.0.0.0/8,nonsense" }, "--trusted-subnets"},
		{"kube address type", func(c *Config) { c.Kube, c.NodeName, c.KubeAddressType = true, "n1", "Internal" }, "--kube-address-type"},
		{"kube without node", func(c *Config) { c.Kube, c.NodeName = true, "" }, "NODE_NAME"},
		{"kubeconfig relative", func(c *Config) { c.Kube, c.NodeName, c.Kubeconfig = true, "n1", "kube.conf" }, "--kubeconfig"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := validConfig(t)
			tc.mutate(&c)
			_, err := c.Validate()
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("Validate() = %v, want an error containing %q", err, tc.want)
			}
		})
	}
}

// TestValidateVXLAN: vxlan is accepted without a password, and with one
// only beside trusted subnets (where its plaintext is allowed).
func TestValidateVXLAN(t *testing.T) {
	c := validConfig(t)
	c.Encap = "VXLAN"
	v, err := c.Validate()
	if err != nil || v.EncapMode != tunnel.ModeVXLAN || v.VXLANPort != tunnel.DefaultVXLANPort || v.VXLANVNI != tunnel.DefaultVNI {
		t.Fatalf("Validate(--encap vxlan) = %+v, %v", v, err)
	}
	c.Password, c.TrustedSubnets = "a-long-enough-pw", "192.168.0.0/16"
	if _, err := c.Validate(); err != nil {
		t.Fatalf("Validate(--encap vxlan, a password, --trusted-subnets) = %v", err)
	}
}

func TestPassword(t *testing.T) {
	dir := t.TempDir()
	write := func(name, data string) string {
		p := dir + "/" + name
		if err := os.WriteFile(p, []byte(data), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	c := validConfig(t)
	c.PasswordFile = write("pw", "correct horse battery\n")
	v, err := c.Validate()
	if err != nil || string(v.Secret) != "correct horse battery" {
		t.Fatalf("Validate() = %q, %v; want the file's password without its line break", v.Secret, err)
	}
	if opts := c.Options(); opts["password"] != "<redacted>" || strings.Contains(fmt.Sprint(opts), "horse") {
		t.Fatalf("options line shows %v", opts)
	}
	c.PasswordFile = write("empty", "\n")
	if _, err := c.Validate(); err == nil || !strings.Contains(err.Error(), "is empty") {
		t.Fatalf("empty password file: %v", err)
	}
	c.PasswordFile, c.Password = "", "from the environment"
	if v, err := c.Validate(); err != nil || string(v.Secret) != "from the environment" {
		t.Fatalf("WEFT_PASSWORD: %q, %v", v.Secret, err)
	}
	if strings.Contains(fmt.Sprint(c.Options()), "environment") {
		t.Fatal("options line shows the password")
	}
	c.Password = ""
	if v, err := c.Validate(); err != nil || v.Secret != nil || c.Options()["password"] != "" {
		t.Fatalf("no password: %q, %v", v.Secret, err)
	}
}

// TestPasswordOneRule: the same password reaches the same bytes from a
// file and from WEFT_PASSWORD, whatever line break ends it (before, a
// trailing newline in WEFT_PASSWORD gave another key: a silent split of
// the cluster); a password of two lines or with a control character is an
// error from both.
func TestPasswordOneRule(t *testing.T) {
	dir := t.TempDir()
	const pw = "  correct horse battery  "
	for i, raw := range []string{pw, pw + "\n", pw + "\r\n"} {
		path := fmt.Sprintf("%s/pw%d", dir, i)
		if err := os.WriteFile(path, []byte(raw), 0o600); err != nil {
			t.Fatal(err)
		}
		for _, c := range []Config{{PasswordFile: path}, {Password: raw}} {
			got, err := c.password()
			if err != nil || string(got) != pw {
				t.Errorf("%+q from %+v: %q, %v; want %q", raw, c.PasswordFile != "", got, err, pw)
			}
		}
	}
	for raw, want := range map[string]string{
		"first line long\nsecond line":   "more than one line",
		"two line breaks at the end\n\n": "more than one line",
		"tab\tinside-the-password":       "control character 0x09",
		"\r\n":                           "is empty",
		"short\n":                        "at least 12",
	} {
		path := dir + "/bad"
		if err := os.WriteFile(path, []byte(raw), 0o600); err != nil {
			t.Fatal(err)
		}
		for src, c := range map[string]Config{"WEFT_PASSWORD": {Password: raw}, "--password-file": {PasswordFile: path}} {
			if _, err := c.password(); err == nil || !strings.Contains(err.Error(), want) || !strings.Contains(err.Error(), src) {
				t.Errorf("%q: %v, want an error naming %s with %q", raw, err, src, want)
			}
		}
	}
}

// TestRequirePassword: with --require-password, no password is an error
// that says where it should come from; with one, it starts as before.
func TestRequirePassword(t *testing.T) {
	c := validConfig(t)
	c.RequirePassword = true
	_, err := c.Validate()
	if err == nil || !strings.Contains(err.Error(), "--require-password") || !strings.Contains(err.Error(), "weft-passwd") {
		t.Fatalf("no password with --require-password: %v", err)
	}
	c.Password = "a-long-enough-password"
	if v, err := c.Validate(); err != nil || string(v.Secret) != c.Password {
		t.Fatalf("a password with --require-password: %q, %v", v.Secret, err)
	}
	c.RequirePassword, c.Password = false, ""
	if v, err := c.Validate(); err != nil || v.Secret != nil {
		t.Fatalf("neither: %q, %v", v.Secret, err)
	}
}

func TestParseInit(t *testing.T) {
	for in, want := range map[string]string{
		"consensus": "consensus", "consensus=3": "consensus=3", "seed=a,b, c": "seed=a,b,c", "observer": "observer",
	} {
		m, err := ParseInit(in)
		if err != nil || m.String() != want {
			t.Errorf("ParseInit(%q) = %v, %v; want %s", in, m, err, want)
		}
	}
	for _, in := range []string{"", "observer=1", "consensus=x", "consensus=-1", "seed"} {
		if _, err := ParseInit(in); err == nil {
			t.Errorf("ParseInit(%q) accepted", in)
		}
	}
}

func TestOptionsHaveEveryFlagAndRange(t *testing.T) {
	opts := Defaults().Options()
	if opts["ipalloc-range"] != "10.32.0.0/12" {
		t.Fatalf("options line lacks ipalloc-range: %v", opts)
	}
	if len(opts) != 30 {
		t.Fatalf("options has %d entries; a new flag must be added to Options()", len(opts))
	}
}

// TestValidateNetworkPolicy: --network-policy is on by default with
// --kube and off without; given true without --kube it is an error that
// says what to do.
func TestValidateNetworkPolicy(t *testing.T) {
	for _, tc := range []struct {
		kube    bool
		flag    string
		want    bool
		wantErr string
	}{
		{kube: true, flag: "", want: true},
		{kube: true, flag: "true", want: true},
		{kube: true, flag: "false", want: false},
		{kube: false, flag: "", want: false},
		{kube: false, flag: "false", want: false},
		{kube: false, flag: "true", wantErr: "--network-policy needs --kube"},
		{kube: true, flag: "maybe", wantErr: "invalid --network-policy"},
	} {
		c := validConfig(t)
		c.Kube, c.NodeName, c.NetworkPolicy = tc.kube, "n1", tc.flag
		v, err := c.Validate()
		switch {
		case tc.wantErr != "":
			if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
				t.Errorf("kube=%v --network-policy=%q: %v, want an error with %q", tc.kube, tc.flag, err, tc.wantErr)
			}
		case err != nil:
			t.Errorf("kube=%v --network-policy=%q: %v", tc.kube, tc.flag, err)
		case v.Policy != tc.want:
			t.Errorf("kube=%v --network-policy=%q: policy %v, want %v", tc.kube, tc.flag, v.Policy, tc.want)
		}
	}
}
