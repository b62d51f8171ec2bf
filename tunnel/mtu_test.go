package tunnel

import "testing"

func TestPodMTU(t *testing.T) {
	for _, tc := range []struct {
		underlay, explicit int
		mode               Mode
		want               int
		wantErr            bool
	}{
		{1500, 0, ModeUDP, 1440, false},
		{1500, 0, ModeIPIP, 1480, false},
		{1500, 0, ModeAuto, 1440, false},
		{1500, 0, ModeVXLAN, 1450, false},
		{9000, 0, ModeVXLAN, 8950, false},
		{1500, 1400, ModeVXLAN, 1400, false},
		{9000, 0, ModeUDP, 8940, false},
		{1500, 1400, ModeUDP, 1400, false},
		{1500, 20, ModeUDP, 0, true},
		{100, 0, ModeUDP, 0, true},
		{1500, 70000, ModeUDP, 0, true},
	} {
		got, err := PodMTU(tc.underlay, tc.explicit, tc.mode)
		if (err != nil) != tc.wantErr || got != tc.want {
			t.Errorf("PodMTU(%d, %d, %s) = %d, %v; want %d, err %v", tc.underlay, tc.explicit, tc.mode, got, err, tc.want, tc.wantErr)
		}
	}
}

func TestParseMode(t *testing.T) {
	for _, s := range []string{"udp", "IPIP", " auto ", "vxlan", "VXLAN"} {
		if _, err := ParseMode(s); err != nil {
			t.Errorf("ParseMode(%q): %v", s, err)
		}
	}
	for _, s := range []string{"", "vxlan2", "sleeve", "fastdp"} {
		if _, err := ParseMode(s); err == nil {
			t.Errorf("ParseMode(%q) accepted", s)
		}
	}
}
